"""The speed gate on the real stack: a drafter that makes decoding slower is refused by default, and
one that does not beat train-free n-gram speculation is refused naming both speed-ups.

The drafter is a real DFlash export (block 4: 3 drafted tokens per step) whose drafts are never
accepted: it always proposes " neoliberal" (see known_drafters.py), which the target never writes
here, so τ = 1.0 and every step pays for the drafter and for verifying 4 tokens instead of 1. On
this host that extra work is small beside one round's timing noise, so whether the measured
speed-up lands under 1.0 is not asserted; the gate's reasons are checked against whatever was
measured, and the minimum speed-up is checked at a level a drafter with τ = 1.0 cannot reach. The
prompts ask the target (SmolLM2, fp32, CPU) to repeat a paragraph word for word, which it does:
n-gram prompt lookup then drafts whole runs that are accepted.

One evaluation in vLLM measures it all (rotated schedule, one round): the drafter's pass (the
counters), the target alone, and n-gram on the target, each on the same prompts. Server start-ups:
three (drafter, target, n-gram), from the suite's pool.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from known_drafters import dflash_checkpoint

from draftflow.evaluation.in_vllm import reusing_factory
from draftflow.evaluation.run import evaluate_prompts
from draftflow.publish import PublishRefused, check_publishable
from draftflow.recipe.schema import EvaluationSection
from draftflow.target import read_target_info

pytestmark = pytest.mark.slow

EOS = 2
NEVER = 40000  # " neoliberal": not in any prompt or reply below
MAX_NEW_TOKENS = 96
COPY = "Repeat this text exactly, word for word:\n\n"
TEXTS = {
    "lighthouse": "The old lighthouse keeper climbed the stairs every evening to light the lamp for the ships "
    "at sea. He carried a small oil can, a clean cloth and a box of matches. When the lamp was lit, he wrote "
    "the time in a thick blue book and watched the waves until the first boat passed the rocks.",
    "pancakes": "Mix two cups of flour with one cup of milk, add three eggs, and stir until the batter is "
    "smooth. Heat a little butter in a wide pan, pour in a ladle of batter and tilt the pan so that it covers "
    "the bottom. Cook each side for one minute, then stack the pancakes on a warm plate.",
    "code": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    "    return a * b\n\n\ndef div(a, b):\n    if b == 0:\n        raise ZeroDivisionError('b is zero')\n"
    "    return a / b\n",
    "baker": "Every morning the baker opened the shop at six. She set out the bread, the rolls and the cakes "
    "on the long wooden counter, wiped the glass of the window and turned the sign on the door. The first "
    "customers were always the two old brothers from the house across the street.",
}


@pytest.fixture(scope="module")
def measured(smollm2_dir, smollm2_model, chat_ids, vllm_servers, tmp_path_factory):
    root = tmp_path_factory.mktemp("speed-gate")
    drafter = dflash_checkpoint(smollm2_dir, root / "never", fixed_token=NEVER, block_size=4)
    startups = vllm_servers.startups
    run = evaluate_prompts(
        drafter,
        [chat_ids(COPY + text) for text in TEXTS.values()],
        target=str(smollm2_dir),
        max_new_tokens=MAX_NEW_TOKENS,
        stop_ids=[EOS],
        min_acceptance_length=1.0,
        agreement_tolerance=0.1,
        prompt_names=list(TEXTS),
        in_vllm=True,
        server_factory=reusing_factory(vllm_servers.get, max_model_len=1024),
        out_dir=root / "eval",
        target_info=read_target_info(str(smollm2_dir)),
        fingerprint="test-fp",
        model=smollm2_model,
        min_speedup=EvaluationSection().min_speedup,  # the recipe's default
        must_beat=["ngram"],
    )
    return run, drafter, vllm_servers.startups - startups


@pytest.mark.slow_ok(
    reason="sets up the module: one evaluation in vLLM with three sides, three server start-ups"
)
def test_the_measurement_has_every_side_and_is_lossless(measured):
    run, _, startups = measured
    ev = run.evaluation
    assert startups <= 3
    assert ev.offline.accepted_tokens == ev.vllm.accepted_tokens == 0 and ev.tau == 1.0  # never accepted
    t = ev.vllm.throughput
    ngram = t["baselines"]["ngram"]
    print(
        f"drafter {t['speedup']:.3f}x, ngram {ngram['speedup']:.3f}x over {t['without_drafter_tok_s']:.1f} tok/s"
    )
    assert ngram["settings"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,  # the drafter's k
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    assert ngram["outputs_identical"] == len(TEXTS) and ev.vllm.outputs_identical == len(TEXTS)
    assert set(t["prompt_timings"]) == {"drafter", "target", "ngram"}
    assert ngram["speedup"] > max(1.0, t["speedup"])  # n-gram drafts whole runs of a copied text


def test_a_drafter_that_does_not_beat_ngram_is_refused_naming_the_numbers(measured, smollm2_dir):
    run, drafter, _ = measured
    ev = run.evaluation
    speedup, ngram = ev.speedup, ev.baselines["ngram"]["speedup"]
    assert not ev.passed_gate and ev.relative_gap == 0.0 and not ev.contract_problems
    with pytest.raises(PublishRefused) as refused:
        check_publishable(drafter, ev, read_target_info(str(smollm2_dir)))
    message = str(refused.value)
    assert message.startswith("gate failed: ") and message.endswith("; nothing was pushed")
    assert message == f"gate failed: {'; '.join(ev.gate_failures())}; nothing was pushed"
    assert re.search(r"speed-up \d\.\d+x does not beat ngram's \d\.\d+x \(evaluation\.must_beat\)", message)
    # the recipe's default minimum (1.0x) refuses exactly when the measured speed-up is under it
    assert ("below evaluation.min_speedup 1.0" in message) == (speedup < 1.0)
    assert f"{speedup:.2f}" in message and f"{ngram:.2f}" in message
    assert "τ" not in message  # τ = 1.0 meets this gate's minimum: only the speed refuses it


def test_a_drafter_below_the_minimum_speedup_is_refused_naming_both(measured, smollm2_dir):
    run, drafter, _ = measured
    ev = replace(run.evaluation, must_beat=[], min_speedup=1.5)  # out of reach with τ = 1.0
    with pytest.raises(PublishRefused) as refused:
        check_publishable(drafter, ev, read_target_info(str(smollm2_dir)))
    named = re.fullmatch(
        r"gate failed: speed-up (\d\.\d+)x over the target is below evaluation\.min_speedup 1\.50*x; "
        r"nothing was pushed",
        str(refused.value),
    )
    assert named and float(named[1]) == pytest.approx(ev.speedup, abs=0.005)


def test_the_report_carries_the_baseline_and_the_table(measured):
    run, _, _ = measured
    data = json.loads(open(run.paths["report"]).read())
    assert data["must_beat"] == ["ngram"] and data["min_speedup"] == 1.0 and not data["passed_gate"]
    assert data["vllm"]["throughput"]["baselines"]["ngram"]["speedup"] > 1.0
    assert data["gate_failures"] == run.evaluation.gate_failures()
    assert len(data["gate_failures"]) == 1 + (run.evaluation.speedup < 1.0)
    summary = open(run.paths["summary"]).read()
    assert (
        "| target alone |" in summary
        and "| ngram (train-free, k=3) |" in summary
        and "| drafter |" in summary
    )
    assert "Gate: speed-up" in summary and "FAIL" in summary
