"""The run reference: resolved once, secret-free, and what every later stage plans from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftflow.recipe.load import RecipeError
from draftflow.recipe.redact import REDACTED, SECRET_OVERRIDES_ENV
from draftflow.run_ref import RUN_REF_ENV, RunRef, holds_secret_values


def _recipe(tmp_path: Path, smollm2_dir: Path, **launch) -> Path:
    data = {
        "name": "ref",
        "target": {"model": str(smollm2_dir)},
        "data": {"sources": [{"kind": "chatterbot", "max_samples": 8}], "max_length": 64},
        "extraction": {"store": str(tmp_path / "store")},
        "vllm": {"endpoints": ["http://127.0.0.1:9"], **({"launch": launch} if launch else {})},
        "drafter": {"kind": "dflash", "block_size": 4},
        "training": {"run_dir": str(tmp_path / "runs"), "pack_length": 128},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_stage_plans_what_the_run_started_with_though_the_file_changed(tmp_path, smollm2_dir):
    path = _recipe(tmp_path, smollm2_dir)
    ref, plan = RunRef.create(str(path), ["drafter.block_size=8"])
    assert (ref.fingerprint, ref.data_root, ref.name) == (plan.fingerprint, plan.data.root, "ref")

    edited = yaml.safe_load(path.read_text())
    edited["data"]["max_length"] = 96  # another data folder, were the file read again
    edited["extraction"]["store"] = str(tmp_path / "elsewhere")
    path.write_text(yaml.safe_dump(edited))

    again = RunRef.model_validate_json(ref.model_dump_json()).plan()  # as a retried task receives it
    assert again.fingerprint == plan.fingerprint and again.data.root == plan.data.root
    assert again.recipe.data.max_length == 64 and again.recipe.drafter.block_size == 8


def test_the_reference_holds_no_secret(tmp_path, smollm2_dir, monkeypatch):
    path = _recipe(tmp_path, smollm2_dir, env={"HF_TOKEN": "hf_literal_secret"})
    secret = "vllm.launch.extra_args=['--api-key', 'sk-override-secret']"
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, json.dumps([secret]))
    ref, plan = RunRef.create(str(path), [f"vllm.launch.extra_args={REDACTED}"])
    shown = ref.model_dump_json()
    assert "hf_literal_secret" not in shown and "sk-override-secret" not in shown
    assert ref.recipe_text is None  # the file holds a secret: kept by path and digest only
    assert ref.plan().recipe.vllm.launch.env["HF_TOKEN"] == "hf_literal_secret"

    path.write_text(path.read_text().replace("hf_literal_secret", "hf_other"))
    with pytest.raises(RecipeError, match="changed .* since this run started"):
        ref.plan()


def test_an_environment_reference_is_not_a_secret(tmp_path, smollm2_dir):
    assert not holds_secret_values({"vllm": {"launch": {"env": {"HF_TOKEN": "${HF_TOKEN}"}}}})
    assert holds_secret_values({"vllm": {"launch": {"extra_args": ["--hf-token", "x"]}}})
    assert not holds_secret_values({"vllm": {"launch": {"extra_args": ["--max-num-seqs", "4"]}}})
    ref, _ = RunRef.create(str(_recipe(tmp_path, smollm2_dir, env={"HF_TOKEN": "${HF_TOKEN}"})), [])
    assert ref.recipe_text is not None


def test_the_trainer_gets_the_reference_through_its_environment(tmp_path, smollm2_dir):
    ref, _ = RunRef.create(str(_recipe(tmp_path, smollm2_dir)), [])
    assert RunRef.from_env(ref.to_env()) == ref
    assert RunRef.from_env({}) is None and list(ref.to_env()) == [RUN_REF_ENV]
