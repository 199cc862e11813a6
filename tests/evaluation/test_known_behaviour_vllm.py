"""vLLM's own acceptance counters against the offline simulator, for drafters whose behaviour is known.

Both checkpoints are real exports (draftflow.models, speculators format) with constructed
weights: the final norm is zero, so every draft logit is 0 and the drafter always proposes
draft id 0 = one fixed token (see known_drafters.py). The target (SmolLM2, fp32) repeats that
token on some prompts and never produces it on others, so acceptance is far from trivial:
full runs of accepted drafts, drafts accepted only in their first position, and nothing.

vLLM (CPU, fp32) and the simulator must then agree EXACTLY: drafts, draft tokens, accepted
tokens and per-position acceptance, in total and per prompt — the same counting rule
(accepted tokens counted past max_tokens and past EOS) and the same greedy tokens. vLLM's
output with the drafter must equal its output without it, and the simulator's (transformers).

Server start-ups: Eagle3, then DFlash, then the plain target (throughput and lossless baseline),
then the same DFlash served with 2 of its block's 3 draft tokens (vLLM builds a shorter block); then
Eagle3 once more (the two drafters decoding in one rotation); then
that DFlash and the target side by side (interleaved), both launched by the test itself.
"""

from __future__ import annotations

import json

import pytest
from known_drafters import dflash_checkpoint, eagle3_checkpoint

from draftflow.evaluation import in_vllm
from draftflow.evaluation.in_vllm import LaunchServerFactory, decode_rounds, reusing_factory
from draftflow.evaluation.run import evaluate_prompts
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.target import read_target_info

pytestmark = pytest.mark.slow

EOS = 2
HA, NA = 421, 15486  # " ha", " na"
QUESTIONS = {
    "laugh": "Laugh: say ha ha ha ha ha ha ha ha ha ha ha ha ha.",  # " ha" × many: whole drafts accepted
    "ha-ha": "Write 'ha ha!' five times.",  # "Ha ha!": one " ha" after "Ha", then no more
    "sing": "Sing: na na na na na na na na na na na na na na",  # " na" × many
    "france": "What is the capital of France?",  # short answer, ends with EOS
}
MAX_NEW_TOKENS = 32
CATEGORIES = {"laugh": "laughing", "ha-ha": "laughing", "sing": "singing", "france": "facts"}


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return [chat_ids(q) for q in QUESTIONS.values()]


@pytest.fixture(scope="module")
def run(smollm2_dir, smollm2_model, prompts, vllm_servers, tmp_path_factory):
    factory = reusing_factory(vllm_servers.get, max_model_len=1024)
    root = tmp_path_factory.mktemp("known")

    def evaluate(folder, measure_baseline: bool, meta: dict | None = None, draft_length: int | None = None):
        return evaluate_prompts(
            folder,
            prompts,
            target=str(smollm2_dir),
            max_new_tokens=MAX_NEW_TOKENS,
            stop_ids=[EOS],
            min_acceptance_length=1.1,
            agreement_tolerance=0.001,
            prompt_names=list(QUESTIONS),
            in_vllm=True,
            server_factory=factory,
            out_dir=folder.with_name(f"{folder.name}-eval{draft_length or ''}"),
            target_info=read_target_info(str(smollm2_dir)),
            fingerprint="test-fp",
            measure_baseline=measure_baseline,
            model=smollm2_model,
            meta=meta,
            speculative_config={"num_speculative_tokens": draft_length} if draft_length else None,
        )

    dflash = dflash_checkpoint(smollm2_dir, root / "dflash", fixed_token=HA, block_size=4)
    return {
        "eagle3": evaluate(
            eagle3_checkpoint(smollm2_dir, root / "eagle3", fixed_token=NA, speculative_tokens=4),
            measure_baseline=False,
        ),
        "dflash": evaluate(
            dflash, measure_baseline=True, meta={"prompt_set": "known", "prompt_categories": CATEGORIES}
        ),
        "dflash-served-2": evaluate(dflash, measure_baseline=False, draft_length=2),
    }


def counts(report):
    return {
        "total": (
            report.drafter,
            report.draft_length,
            report.drafts,
            report.draft_tokens,
            report.accepted_tokens,
            report.accepted_per_position,
        ),
        "per_prompt": [
            (p.prompt_id, p.drafts, p.draft_tokens, p.accepted, p.accepted_per_position, p.generated_tokens)
            for p in report.per_prompt
        ],
    }


@pytest.mark.slow_ok(
    reason="the first one sets up the module: four evaluations in vLLM, five server start-ups"
)
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dflash-served-2"])
def test_vllm_counters_equal_the_simulator_exactly(run, kind):
    ev = run[kind].evaluation
    print(
        f"{kind}: offline τ {ev.offline.mean_acceptance_length:.4f} per position {ev.offline.per_position}; "
        f"vLLM τ {ev.vllm.mean_acceptance_length:.4f} per position {ev.vllm.per_position}"
    )
    assert counts(ev.vllm) == counts(ev.offline)
    assert ev.vllm.mean_acceptance_length == ev.offline.mean_acceptance_length and ev.relative_gap == 0.0
    assert ev.agrees and ev.passed_gate and ev.publishable


def test_acceptance_is_what_the_constructed_drafters_imply(run):
    dflash = {p.prompt_id: p for p in run["dflash"].evaluation.offline.per_prompt}
    eagle3 = {p.prompt_id: p for p in run["eagle3"].evaluation.offline.per_prompt}
    # " ha" drafter: whole blocks accepted on the laugh, one token after "Ha", nothing elsewhere
    assert dflash["laugh"].accepted_per_position[2] >= 5 and dflash["laugh"].acceptance_length > 3
    assert dflash["ha-ha"].accepted_per_position == [1, 0, 0]
    assert dflash["sing"].accepted == dflash["france"].accepted == 0
    # served with 2 of its 3 tokens: vLLM and the simulator draft 2 per step, more steps on the laugh
    short = {p.prompt_id: p for p in run["dflash-served-2"].evaluation.vllm.per_prompt}
    assert run["dflash-served-2"].evaluation.vllm.draft_length == 2
    assert len(short["laugh"].accepted_per_position) == 2 and short["laugh"].drafts > dflash["laugh"].drafts
    assert short["laugh"].acceptance_length < dflash["laugh"].acceptance_length
    # " na" chain: long runs on the song only
    assert eagle3["sing"].accepted_per_position[3] >= 4 and eagle3["laugh"].accepted == 0
    # the answer about France ends with EOS before max_tokens: fewer drafts, output cut at EOS
    assert dflash["france"].generated_tokens < MAX_NEW_TOKENS
    assert run["dflash"].offline.outputs[3][-1] == EOS


def test_outputs_are_lossless_in_vllm(run):
    dflash, eagle3 = run["dflash"], run["eagle3"]
    plain = dflash.vllm.baseline_outputs  # SmolLM2 served without a drafter, same settings
    assert dflash.vllm.outputs == plain and eagle3.vllm.outputs == plain
    assert dflash.offline.outputs == plain and eagle3.offline.outputs == plain
    assert dflash.vllm.report.outputs_identical == 4
    assert run["dflash-served-2"].vllm.outputs == plain
    t = dflash.vllm.report.throughput
    assert t["with_drafter_tok_s"] > 0 and t["without_drafter_tok_s"] > 0 and t["speedup"] > 0
    print(f"throughput: {t}")


def test_reports_written(run):
    paths = run["dflash"].paths
    data = json.loads(open(paths["report"]).read())
    assert (
        data["vllm"]["throughput"]["speedup"] > 0 and data["offline"]["per_prompt"][0]["prompt_id"] == "laugh"
    )
    assert "| vllm | 4 |" in open(paths["summary"]).read()
    assert open(paths["chart"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_tau_per_category_in_vllm_equals_the_simulator_per_category(run):
    ev = run["dflash"].evaluation
    table = ev.to_dict()["per_category"]
    assert table["vllm"] == table["offline"] and set(table["vllm"]) == {"laughing", "singing", "facts"}
    laughing = [p for p in ev.vllm.per_prompt if CATEGORIES[p.prompt_id] == "laughing"]
    pooled = 1 + sum(p.accepted for p in laughing) / sum(p.drafts for p in laughing)
    assert table["vllm"]["laughing"]["tau"] == pooled
    # " ha" drafter: whole blocks on the laugh, one token on "ha ha!" (pooled: 1.625); nothing elsewhere
    vllm = table["vllm"]
    assert vllm["laughing"]["tau"] > 1.5 and vllm["singing"]["tau"] == vllm["facts"]["tau"] == 1.0
    assert "| laughing | 2 |" in open(run["dflash"].paths["summary"]).read()


def test_two_drafters_decode_in_one_rotation_and_each_keeps_its_own_counters(run, prompts, vllm_servers):
    """decode_rounds (bench/quality.py --compare A B): one pass per side on fresh servers, counters
    read on each drafter's side. The first side is the server this module left running; the
    target-alone side of a rotation is the DFlash evaluation's own (measure_baseline)."""
    factory = reusing_factory(vllm_servers.get, max_model_len=1024)
    short = run["dflash-served-2"].evaluation
    sides = {
        "dflash, 2 served": (short.checkpoint, {"num_speculative_tokens": 2}),
        "eagle3": (run["eagle3"].evaluation.checkpoint, None),
    }
    timed = decode_rounds(factory, sides, prompts, MAX_NEW_TOKENS, 1, scrape=list(sides))
    assert {name: len(runs) for name, runs in timed.items()} == {name: 1 for name in sides}
    plain = run["dflash"].vllm.baseline_outputs
    assert all(runs[0].outputs == plain for runs in timed.values())
    # greedy and deterministic: each drafter's counters repeat its own evaluation's, prompt by prompt
    for name, kind in (("dflash, 2 served", "dflash-served-2"), ("eagle3", "eagle3")):
        expected = [(p.drafts, p.accepted) for p in run[kind].evaluation.vllm.per_prompt]
        assert [(c.drafts, c.accepted) for c in timed[name][0].per_prompt] == expected


def test_interleaved_evaluation_runs_both_servers_under_one_host_lock_and_takes_turns(
    run, prompts, smollm2_dir, vllm_python, vllm_servers, tmp_path, monkeypatch
):
    """evaluate_in_vllm(interleave=True) (evaluation.speed_schedule: interleaved, and bench/quality.py
    --interleave): LaunchServerFactory(side_by_side=True) starts the target's and the drafter's
    servers at once; the first holds the CPU host lock (another process would wait) and the second
    starts beside it; each prompt is decoded on both back to back, the order rotating by prompt.
    The counters, read on the interleaved pass, equal the drafter's own evaluation's."""
    vllm_servers.stop()  # the pool's server holds the host lock; this test takes it itself
    launch = VLLMLaunchSection(python=vllm_python, device="cpu", max_model_len=1024, cpu_reserved_cores=0)
    factory = LaunchServerFactory(launch, log_dir=tmp_path, side_by_side=True)
    urls, lock_free_while_serving = [], []
    complete = in_vllm._Server.complete

    def spy(self, prompt, max_tokens):
        if max_tokens == MAX_NEW_TOKENS:  # a timed request (the counters' scrapes use 1 token)
            urls.append(self.url)
            lock_free_while_serving.append(host_lock_is_free())
        return complete(self, prompt, max_tokens)

    monkeypatch.setattr(in_vllm._Server, "complete", spy)
    short = run["dflash-served-2"].evaluation
    result = in_vllm.evaluate_in_vllm(
        short.checkpoint,
        prompts,
        max_new_tokens=MAX_NEW_TOKENS,
        server_factory=factory,
        prompt_names=list(QUESTIONS),
        speculative_config={"num_speculative_tokens": 2},
        interleave=True,
    )
    assert host_lock_is_free() and factory._running == 0
    assert lock_free_while_serving == [False] * 2 * len(prompts)
    drafter, target = urls[0], urls[1]  # the first prompt goes to the drafter first
    assert drafter != target
    assert urls == [drafter, target, target, drafter] * 2  # D T, T D, D T, T D: both up throughout
    report, plain = result.report, run["dflash"].vllm.baseline_outputs
    assert result.outputs == plain and result.baseline_outputs == plain
    assert report.outputs_identical == len(prompts)
    assert counts(report) == counts(short.vllm)
    assert report.throughput["schedule"] == "interleaved" and report.throughput["speedup"] > 0


def host_lock_is_free() -> bool:
    import fcntl

    from draftflow.vllm.launch import CPU_HOST_LOCK

    with open(CPU_HOST_LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True
