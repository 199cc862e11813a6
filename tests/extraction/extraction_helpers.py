"""Helpers shared by the extraction tests (imported by name, like tests/store/store_synthetic.py)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import torch
import yaml

LAYER_IDS = [2, 15, 27, 30]  # 30 = SmolLM2's last layer output, before the final norm
HIDDEN = 576


def recipe_dict(model: Path, store: str, endpoint: str, staging: str | None = None, **data) -> dict:
    """A tiny recipe: SmolLM2, chatterbot questions, 4 samples per shard, fp32 hidden states.

    `staging`: the test server's staging folder (the only place the client touches files)."""
    return {
        "name": "extraction-test",
        "target": {"model": str(model)},
        "data": {
            "sources": [{"kind": "chatterbot", "max_samples": 40}],
            "num_samples": 20,
            "eval_samples": 4,
            "max_length": 256,
            "seed": 3,
            **data,
        },
        "extraction": {"layer_ids": LAYER_IDS, "dtype": "float32", "store": store, "samples_per_shard": 4},
        "vllm": {"endpoints": [endpoint], **({"staging_dirs": [str(staging)]} if staging else {})},
        "drafter": {"kind": "dflash", "block_size": 4, "num_layers": 1},
    }


def launch_recipe_dict(model: Path, store: str, port: int, staging: Path, vllm_python: str, **data) -> dict:
    """recipe_dict whose `vllm.launch` starts SmolLM2 (CPU) at 127.0.0.1:`port` when none answers."""
    recipe = recipe_dict(model, store, f"http://127.0.0.1:{port}", str(staging), **data)
    recipe["vllm"]["launch"] = {
        "python": vllm_python,
        "device": "cpu",
        "max_model_len": 1024,
        "staging_dir": str(staging),
        "startup_timeout_s": 600,
    }
    return recipe


def write_recipe_file(
    path: Path, model: Path, store: str, endpoint: str, staging: str | None = None, **data
) -> str:
    path.write_text(yaml.safe_dump(recipe_dict(model, store, endpoint, staging, **data), sort_keys=False))
    return str(path)


def copy_prepared(src_root: str, dst_root: str) -> None:
    """Give a fresh data folder the prepared samples of another one (same fingerprint), no shards."""
    shutil.copytree(Path(src_root) / "prepared", Path(dst_root) / "prepared")


def request_count(url: str) -> float:
    """Requests the server has finished (all reasons), from its Prometheus counters."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def assert_bit_identical(got, want) -> None:
    """Same sample, same bytes: hidden states compared as raw bits, token ids and mask exactly."""
    assert got.sample_id == want.sample_id
    assert (
        got.hidden_states.dtype == want.hidden_states.dtype
        and got.hidden_states.shape == want.hidden_states.shape
    )
    assert torch.equal(got.hidden_states.view(torch.int32), want.hidden_states.view(torch.int32)), (
        got.sample_id
    )
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.loss_mask, want.loss_mask)


def plant_stale_staging_file(staging: Path) -> Path:
    """A hidden-state file a killed client never read, as the connector names it, an hour old."""
    path = staging / "cmpl-killed-client-0-abcd1234.safetensors"
    path.write_bytes(b"x")
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    return path
