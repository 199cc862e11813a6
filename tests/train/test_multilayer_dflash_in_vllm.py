"""A multi-layer DFlash served by the real CPU vLLM drafts exactly as draftflow's simulator says,
with the draftflow vLLM plugin loaded by the server.

The drafter is trained by `draftflow.train` (2 layers, SmolLM2 states). Then its layer 1 is
re-parametrised without changing what it computes: k_norm x C and q_norm / C with C = 1/16 (RoPE is
linear, so every attention logit q.k is unchanged; the simulator's drafts stay the same), so layer
1's k_norm is far from layer 0's, which the CPU build's stock kernel would apply to every layer.

Where the defect shows decisively: tests/models/test_vllm_parity.py (vLLM's own classes; without
the plugin 504/512 draft logits of a 2-layer DFlash differ). Here it does not: this drafter is
accepted so rarely (τ ≈ 1.03) that a server without the plugin (`VLLM_PLUGINS=none`, tried with
C = 8 and 1/16) gave the same acceptance counts, so that comparison is not part of the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from draftflow.evaluation.in_vllm import reusing_factory
from draftflow.evaluation.run import evaluate_prompts, known_vllm_issue
from draftflow.extraction.samples import train_set
from draftflow.paths import EXPORT_WEIGHTS
from draftflow.plan import Plan
from draftflow.store import Store
from draftflow.train import RESULT_PREFIX
from draftflow.vllm.plugin import DFLASH_CPU_K_NORM, PLUGIN_NAME, installed_fixes

pytestmark = pytest.mark.slow
EOS = 2
LAYERS = 2
C = 1 / 16
NO_PLUGIN = {"VLLM_PLUGINS": "none"}  # vLLM loads only the general plugins named here: none of ours


def _train(recipe: str) -> str:
    settings = [
        f"drafter.num_layers={LAYERS}",
        "training.epochs=4",
        "training.lr=3e-3",
        "drafter.max_anchors=64",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "draftflow.train", recipe, "--run-id", "multilayer"]
        + [a for s in settings for a in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX))
    return json.loads(line[len(RESULT_PREFIX) :])["export_dir"]


def _rescale_layer_1(folder: Path) -> None:
    path = folder / EXPORT_WEIGHTS
    tensors = load_file(path)
    tensors["layers.1.self_attn.k_norm.weight"] *= C
    tensors["layers.1.self_attn.q_norm.weight"] /= C
    save_file(tensors, path, metadata={"format": "pt"})


def test_multilayer_dflash_drafts_in_cpu_vllm_as_the_simulator(train_dir, smollm2_dir, vllm_servers):
    recipe = str(train_dir / "recipe.yaml")
    folder = Path(_train(recipe))
    _rescale_layer_1(folder)
    plan = Plan.load(recipe)
    train = train_set(Store(plan.data))
    prompts = []
    for sid in list(train.positions)[:6]:  # user turns of training conversations: drafts get accepted
        ids, mask = train.tokens(sid)
        prompts.append([int(t) for t in ids[: int(mask.argmax())]])

    fixes = installed_fixes(vllm_servers.python)
    assert DFLASH_CPU_K_NORM in fixes, (
        f"{PLUGIN_NAME} is not installed in {vllm_servers.python}: make bootstrap"
    )
    assert known_vllm_issue(folder, "cpu", fixes) is None
    run = evaluate_prompts(
        folder,
        prompts,
        target=str(smollm2_dir),
        max_new_tokens=48,
        stop_ids=[EOS],
        min_acceptance_length=1.0,
        agreement_tolerance=0.001,
        in_vllm=True,
        measure_baseline=False,
        server_factory=reusing_factory(vllm_servers.get, max_model_len=1024),
        target_info=plan.target,
        fingerprint=plan.fingerprint,
    )
    offline, served = run.offline.report, run.vllm.report
    print(
        f"{LAYERS}-layer DFlash: offline τ {offline.mean_acceptance_length:.4f}, vLLM τ {served.mean_acceptance_length:.4f}"
    )
    assert offline.accepted_tokens > 0, "the drafter must be accepted somewhere, or nothing is compared"
    assert run.vllm.outputs == run.offline.outputs
    per_prompt = [(p.drafts, p.accepted, p.accepted_per_position) for p in offline.per_prompt]
    assert [(p.drafts, p.accepted, p.accepted_per_position) for p in served.per_prompt] == per_prompt
    assert run.evaluation.agrees
    server_log = Path(vllm_servers.current[1].spec.log_path).read_text()
    assert "draftflow-vllm-cpu: DFlash context k_norm runs per layer on CPU" in server_log

    # A server that does not load the plugin is named as having the defect before anything runs.
    issue = known_vllm_issue(folder, "cpu", installed_fixes(vllm_servers.python, NO_PLUGIN))
    assert issue and issue.startswith(
        "known defect: vLLM 0.32's CPU build drafts wrongly with a 2-layer DFlash"
    )
