"""A drafter trained by `draftflow.train` is served by the real vLLM as SmolLM2's speculative model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftflow.evaluation.in_vllm import reusing_factory
from draftflow.evaluation.run import evaluate_prompts
from draftflow.extraction.samples import train_set
from draftflow.plan import Plan
from draftflow.store import Store
from draftflow.train import RESULT_PREFIX

pytestmark = pytest.mark.slow
EOS = 2


@pytest.mark.slow_ok(reason="trains a DFlash drafter with torchrun, then serves it in vLLM")
def test_trained_dflash_is_lossless_in_vllm_with_non_zero_acceptance(train_dir, smollm2_dir, vllm_servers):
    recipe = str(train_dir / "recipe.yaml")
    settings = ["--set", "training.epochs=6", "--set", "training.lr=3e-3", "--set", "drafter.max_anchors=64"]
    proc = subprocess.run(
        [sys.executable, "-m", "draftflow.train", recipe, "--run-id", "served", *settings],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(
        next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX))[len(RESULT_PREFIX) :]
    )

    plan = Plan.load(recipe)
    train = train_set(Store(plan.data))
    prompts = []
    for sid in list(train.positions)[:6]:  # the user turn of training conversations
        ids, mask = train.tokens(sid)
        first_answer = int(mask.argmax())
        prompts.append([int(t) for t in ids[:first_answer]])

    run = evaluate_prompts(
        Path(result["export_dir"]),
        prompts,
        target=str(smollm2_dir),
        max_new_tokens=48,
        stop_ids=[EOS],
        min_acceptance_length=1.0,
        agreement_tolerance=0.10,
        in_vllm=True,
        # no target-alone server: the offline simulator's outputs are SmolLM2's own greedy tokens
        # (transformers), and vLLM with the drafter must reproduce them
        measure_baseline=False,
        server_factory=reusing_factory(vllm_servers.get, max_model_len=1024),
        target_info=plan.target,
        fingerprint=plan.fingerprint,
    )
    served = run.vllm.report
    assert run.vllm.baseline_outputs is None and served.throughput is None
    assert run.vllm.outputs == run.offline.outputs, "greedy output with the drafter must equal SmolLM2's own"
    assert f"{len(prompts)}/{len(prompts)} outputs identical to the offline simulator's" in served.notes
    assert all(len(out) > 0 for out in run.vllm.outputs)
    assert served.drafts > 0 and served.accepted_tokens > 0, served.to_dict()
    assert run.evaluation.agrees, (run.offline.report.mean_acceptance_length, served.mean_acceptance_length)
