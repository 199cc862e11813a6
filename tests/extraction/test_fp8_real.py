"""FP8 end to end on the real stack: SmolLM2 states from the real vLLM server stored as float8_e4m3,
compared with the full-precision states the server returns, then trained on by `draftflow.train`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from extraction_helpers import HIDDEN, LAYER_IDS, recipe_dict

from draftflow.async_run import run_coroutine
from draftflow.extraction import extract_samples, make_client, run_extraction, train_set
from draftflow.plan import Plan
from draftflow.store import Store, load_sample, read_manifest, verify
from draftflow.train.__main__ import RESULT_PREFIX
from draftflow.train.metrics import parse_line

pytestmark = pytest.mark.slow


def test_fp8_store_from_vllm_is_close_to_full_precision_and_trains(
    extraction_server, staging_dir: Path, smollm2_dir: Path, tmp_path: Path
):
    data = recipe_dict(smollm2_dir, str(tmp_path / "store"), extraction_server.url, str(staging_dir))
    data["extraction"]["dtype"] = "float8_e4m3"
    data["drafter"] = {
        "kind": "dflash",
        "block_size": 4,
        "max_anchors": 16,
        "num_layers": 1,
        "draft_vocab_size": 2048,
    }
    data["training"] = {
        "epochs": 2,
        "lr": 1e-3,
        "pack_length": 512,
        "device": "cpu",
        "log_every": 1,
        "warmup_ratio": 0.0,
        "run_dir": str(tmp_path / "runs"),
    }
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    plan = Plan.load(str(recipe))

    summary = run_extraction(plan)
    assert summary.ok and summary.samples_ok == 16, summary
    store = Store(plan.data)
    manifest = read_manifest(store)
    assert set(manifest["dtype"].to_pylist()) == {"float8_e4m3"} and verify(store).ok
    rows = manifest.to_pylist()
    assert all(r["hidden_states_length"] == r["num_tokens"] * len(LAYER_IDS) * HIDDEN for r in rows)

    # The same samples' full-precision states, straight from the server (fp32 on this CPU server).
    ids = [r["sample_id"] for r in rows[:3]]

    async def full_precision():
        async with make_client(plan, [extraction_server.url]) as client:
            return await extract_samples(train_set(store), ids, client, dtype="float32")

    for reference in run_coroutine(full_precision()):
        got = load_sample(store, manifest, reference.sample_id, verify="sample")
        want = reference.hidden_states
        assert got.hidden_states.dtype == torch.float32 and got.hidden_states.shape == want.shape
        err = got.hidden_states - want
        per_layer = err.norm(dim=(0, 2)) / want.norm(dim=(0, 2))
        assert bool((per_layer < 0.05).all()), per_layer  # e4m3 keeps ~3 significant bits per value
        worst = (err.abs().amax(-1) / want.abs().amax(-1)).max().item()
        assert worst <= 16 / 448 + 2**-9 + 1e-4, worst  # half an fp8 step at the row maximum

    proc = subprocess.run(
        [sys.executable, "-m", "draftflow.train", str(recipe), "--run-id", "fp8"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    metrics = [m for m in map(parse_line, lines) if m]
    result = json.loads(next(ln for ln in lines if ln.startswith(RESULT_PREFIX))[len(RESULT_PREFIX) :])
    assert result["steps"] >= 2 and len(metrics) == result["steps"]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert Path(result["export_dir"]).is_dir()
