"""Checkpoints that pass publishing's checks, one distinct version each, for the release tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from known_drafters import dflash_checkpoint
from safetensors.torch import load_file, save_file

from draftflow.paths import EXPORT_RECIPE, EXPORT_WEIGHTS

RECIPE = "rel-test"  # the recipe's name: its versions are published as rel-test-VERSION


@pytest.fixture
def base_export(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A contract-sound DFlash export with the recipe the trainer writes beside it."""
    folder = dflash_checkpoint(tiny_llama_dir, tmp_path / "base")
    data = tmp_path / "chats.jsonl"
    data.write_text("")
    recipe = {
        "name": RECIPE,
        "target": {"model": str(tiny_llama_dir)},
        "data": {"sources": [{"kind": "sharegpt", "path": str(data)}], "eval_samples": 4},
        "extraction": {"store": str(tmp_path / "store")},
        "drafter": {"kind": "dflash", "block_size": 4},
        "training": {"run_dir": str(tmp_path / "runs")},
    }
    (folder / EXPORT_RECIPE).write_text(yaml.safe_dump(recipe, sort_keys=False))
    return folder


@pytest.fixture
def checkpoint(base_export: Path, tmp_path: Path):
    """``checkpoint(i, tau=1.8)``: (folder, report.json) of a checkpoint with its own weights
    (the base's, scaled by 1 + i/100) and a passing evaluation report of exactly those bytes."""
    from test_publish_core import report_for

    made: dict[int, tuple[Path, Path]] = {}

    def make(i: int, tau: float = 1.8) -> tuple[Path, Path]:
        if i in made:
            return made[i]
        folder = tmp_path / f"export-{i}"
        shutil.copytree(base_export, folder)
        weights = load_file(str(folder / EXPORT_WEIGHTS))
        weights["fc.weight"] = weights["fc.weight"] * (1 + i / 100)  # as if trained further
        save_file(weights, str(folder / EXPORT_WEIGHTS))
        made[i] = folder, report_for(folder, tmp_path / f"eval-{i}", tau=tau)
        return made[i]

    return make
