"""The speed gate (evaluation.min_speedup, evaluation.must_beat), fast: constructed evaluations, the
schema, the baseline registry, publishing's refusal, and the speed rounds with the baselines as more
sides, decoded by stand-in servers (no vLLM). The real stack: test_speed_gate_vllm.py."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from pydantic import ValidationError

from draftflow.evaluation import baselines as baselines_module
from draftflow.evaluation import in_vllm
from draftflow.evaluation.baselines import BaselineUnavailable, baseline_configs, check_available
from draftflow.evaluation.in_vllm import SpecCounters, evaluate_in_vllm
from draftflow.evaluation.report import AcceptanceReport, Evaluation, PromptAcceptance
from draftflow.evaluation.run import EvaluationError, evaluate_checkpoint
from draftflow.evaluation.speed import GenerationRun, prompt_timings, speed_table
from draftflow.models.speculators import checkpoint_digest
from draftflow.publish import PublishRefused, check_publishable
from draftflow.recipe import RecipeError, validate
from draftflow.recipe.schema import EvaluationSection

DEMO = str(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-dflash-cpu-demo.yaml")


def acceptance(source: str, tau: float) -> AcceptanceReport:
    drafts, accepted = 20, round((tau - 1.0) * 20)
    return AcceptanceReport(
        source=source,
        drafter="dflash",
        draft_length=3,
        num_prompts=2,
        drafts=drafts,
        draft_tokens=60,
        accepted_tokens=accepted,
        accepted_per_position=[min(accepted, drafts), max(accepted - drafts, 0), 0],
        per_prompt=[PromptAcceptance("a", 10, accepted, 40, 30), PromptAcceptance("b", 10, 0, 40, 30)],
    )


def throughput(speedup: float, baselines: dict[str, float] | None = None) -> dict:
    target = 40.0
    out = {
        "with_drafter_tok_s": target * speedup,
        "without_drafter_tok_s": target,
        "speedup": speedup,
        "rounds": [speedup],
        "schedule": "rotated",
    }
    if baselines:
        out["baselines"] = {
            name: {
                "settings": baseline_configs([name], 3)[name],
                "tok_s": target * s,
                "speedup": s,
                "rounds": [s],
                "outputs_identical": 2,
                "prompts": 2,
            }
            for name, s in baselines.items()
        }
    return out


def evaluation(
    *,
    tau: float = 1.5,
    speedup: float | None = 1.2,
    baselines: dict[str, float] | None = None,
    min_tau: float = 1.05,
    min_speedup: float | None = 1.0,
    must_beat: list[str] | None = None,
    digest: str | None = None,
) -> Evaluation:
    vllm = acceptance("vllm", tau)
    if speedup is not None:
        vllm.throughput = throughput(speedup, baselines)
    return Evaluation(
        offline=acceptance("offline", tau),
        vllm=vllm,
        min_acceptance_length=min_tau,
        agreement_tolerance=0.1,
        checkpoint="/ckpt",
        meta={"recipe": "speed-gate"},
        checkpoint_digest=digest,
        min_speedup=min_speedup,
        must_beat=list(must_beat or []),
    )


# --- the gate -------------------------------------------------------------------------------


def test_a_drafter_slower_than_the_target_fails_the_default_gate():
    ev = evaluation(speedup=0.93)
    assert ev.gate_failures() == ["speed-up 0.93x over the target is below evaluation.min_speedup 1.00x"]
    assert not ev.passed_gate and not ev.publishable
    md = ev.markdown()
    assert "Gate: τ 1.500 vs minimum 1.050: PASS" in md
    assert "Gate: speed-up 0.93x vs minimum 1.00x: FAIL" in md
    data = ev.to_dict()
    assert not data["passed_gate"] and data["gate_failures"] == ev.gate_failures() and data["speedup"] == 0.93


def test_a_speed_up_that_only_rounds_to_the_minimum_shows_the_digits_that_differ():
    ev = evaluation(speedup=0.998)
    assert ev.gate_failures() == ["speed-up 0.998x over the target is below evaluation.min_speedup 1.000x"]
    assert evaluation(speedup=1.0).passed_gate  # exactly the minimum passes


def test_a_drafter_that_does_not_beat_ngram_is_refused_naming_both_speed_ups():
    ev = evaluation(speedup=1.02, baselines={"ngram": 1.31}, must_beat=["ngram"])
    assert ev.gate_failures() == ["speed-up 1.02x does not beat ngram's 1.31x (evaluation.must_beat)"]
    assert "Gate: speed-up 1.02x vs ngram's 1.31x: FAIL" in ev.markdown()
    tie = evaluation(speedup=1.3, baselines={"ngram": 1.3}, must_beat=["ngram"])
    assert tie.gate_failures() == ["speed-up 1.3000x does not beat ngram's 1.3000x (evaluation.must_beat)"]


def test_a_faster_drafter_passes_and_the_table_shows_every_side():
    ev = evaluation(speedup=1.5, baselines={"ngram": 1.31, "suffix": 1.2}, must_beat=["ngram", "suffix"])
    assert ev.gate_failures() == [] and ev.passed_gate and ev.publishable
    md = ev.markdown()
    assert "Gate: speed-up 1.50x vs minimum 1.00x: PASS" in md
    assert "Gate: speed-up 1.50x vs ngram's 1.31x: PASS" in md and "vs suffix's 1.20x: PASS" in md
    assert "| target alone | 40.0 | 1.00x |" in md
    assert "| ngram (train-free, k=3) | 52.4 | 1.31x |" in md
    assert "| suffix (train-free, k=3) | 48.0 | 1.20x |" in md
    assert "| drafter | 60.0 | 1.50x |" in md


def test_baselines_measured_but_not_required_are_reported_and_not_gated():
    ev = evaluation(speedup=1.1, baselines={"ngram": 1.31})
    assert ev.passed_gate and "| ngram (train-free, k=3) |" in ev.markdown()


def test_a_required_baseline_missing_from_a_measured_report_fails():
    ev = evaluation(speedup=1.5, must_beat=["ngram"])
    (failure,) = ev.gate_failures()
    assert "ngram was not measured" in failure and "evaluation.must_beat" in failure


@pytest.mark.parametrize("how", ["no vLLM", "no speed-up"])
def test_without_a_measured_speed_up_only_tau_is_gated_and_the_report_says_so(how):
    ev = evaluation(speedup=None, must_beat=["ngram"])
    if how == "no vLLM":
        ev.vllm = None
    assert ev.speedup is None and ev.passed_gate and ev.gate_failures() == []
    assert ev.speed_gate_note().startswith("speed-up not measured: not gated")
    assert "Gate: speed-up not measured: not gated" in ev.markdown()
    assert ev.to_dict()["speed_gate_note"] == ev.speed_gate_note()
    assert evaluation(speedup=None, tau=1.0).gate_failures() == [
        "τ 1.000 < evaluation.min_acceptance_length 1.05"
    ]


def test_min_speedup_none_gates_no_speed():
    ev = evaluation(speedup=0.5, min_speedup=None)
    assert ev.passed_gate and ev.speed_gate_note() is None
    assert "Gate: speed-up" not in ev.markdown()


# --- the report -----------------------------------------------------------------------------


def test_report_round_trip_keeps_the_settings_and_the_baselines():
    ev = evaluation(speedup=1.02, baselines={"ngram": 1.31}, must_beat=["ngram"], min_speedup=1.1)
    ev.vllm.throughput["prompt_timings"] = {"target": {"a": [40, 1.0]}, "drafter": {"a": [40, 0.8]}}
    back = Evaluation.from_dict(json.loads(json.dumps(ev.to_dict())))
    assert back == ev and back.to_dict() == ev.to_dict()
    assert back.baselines["ngram"]["settings"]["prompt_lookup_max"] == 4
    assert back.gate_failures() == ev.gate_failures() and len(back.gate_failures()) == 2


def test_an_old_report_without_the_speed_gate_loads_with_it_off():
    data = evaluation(speedup=0.5).to_dict()
    for key in ("min_speedup", "must_beat", "speedup", "gate_failures", "speed_gate_note"):
        data.pop(key)
    old = Evaluation.from_dict(data)
    assert old.min_speedup is None and old.must_beat == [] and old.passed_gate


def test_the_speed_table_per_category():
    t = throughput(1.5, {"ngram": 1.2})
    t["prompt_timings"] = {
        "target": {"a": [40, 2.0], "b": [40, 1.0]},
        "ngram": {"a": [40, 1.0], "b": [40, 1.0]},
        "drafter": {"a": [40, 0.5], "b": [40, 1.0]},
    }
    lines = speed_table(t, {"a": "chat", "b": "coding"})
    assert "| category | prompts | target alone | ngram (train-free, k=3) | drafter |" in lines
    assert "| chat | 1 | 20.0 | 40.0 (2.00x) | 80.0 (4.00x) |" in lines
    assert "| coding | 1 | 40.0 | 40.0 (1.00x) | 40.0 (1.00x) |" in lines
    assert not any("category" in line for line in speed_table(t))  # no categories: one table


def test_the_model_card_shows_the_speed_table_and_the_speed_gate():
    from draftflow.model_card import _speed, _verdict

    ev = evaluation(speedup=1.5, baselines={"ngram": 1.31}, must_beat=["ngram"])
    assert "| ngram (train-free, k=3) | 52.4 | 1.31x |" in _speed(ev)
    verdict = "\n".join(_verdict(ev))
    assert "speed-up 1.50x over the verifier alone (at least 1.00x required)" in verdict
    assert "beats ngram (train-free speculation, 1.31x)" in verdict
    unmeasured = evaluation(speedup=None)
    assert _speed(unmeasured) == [] and "speed-up not measured: not gated" in "\n".join(_verdict(unmeasured))


# --- publishing -----------------------------------------------------------------------------


def test_check_publishable_refuses_with_every_reason(tmp_path):
    digest = checkpoint_digest(tmp_path)
    slow = evaluation(speedup=0.93, tau=1.0, digest=digest)
    with pytest.raises(PublishRefused) as refused:
        check_publishable(tmp_path, slow)
    assert str(refused.value) == (
        "gate failed: τ 1.000 < evaluation.min_acceptance_length 1.05; speed-up 0.93x over the target "
        "is below evaluation.min_speedup 1.00x; nothing was pushed"
    )
    weak = evaluation(speedup=1.02, baselines={"ngram": 1.31}, must_beat=["ngram"], digest=digest)
    with pytest.raises(PublishRefused, match=r"^gate failed: speed-up 1\.02x does not beat ngram's 1\.31x"):
        check_publishable(tmp_path, weak)
    tau_only = evaluation(speedup=None, tau=1.0, digest=digest)  # the message tests grep for
    with pytest.raises(
        PublishRefused, match=r"^gate failed: τ 1.000 < evaluation.min_acceptance_length 1.05;"
    ):
        check_publishable(tmp_path, tau_only)


# --- the schema and the registry ------------------------------------------------------------


def test_schema_defaults_and_must_beat_needs_the_speed_measured():
    section = EvaluationSection()
    assert section.min_speedup == 1.0 and section.must_beat == []
    assert EvaluationSection(min_speedup=None).min_speedup is None
    assert EvaluationSection(must_beat=["ngram", "suffix"]).must_beat == ["ngram", "suffix"]
    for off in ({"measure_speedup": False}, {"in_vllm": False}):
        with pytest.raises(ValidationError, match="evaluation.must_beat"):
            EvaluationSection(must_beat=["ngram"], **off)
    assert EvaluationSection(measure_speedup=False).min_speedup == 1.0  # not gated, not refused
    with pytest.raises(ValidationError, match="duplicates"):
        EvaluationSection(must_beat=["ngram", "ngram"])
    with pytest.raises(ValidationError, match="'ngram' or 'suffix'"):
        EvaluationSection(must_beat=["eagle"])


def test_a_recipe_with_must_beat_but_no_speed_measured_fails_naming_the_field(smollm2_dir):
    with pytest.raises(RecipeError) as info:
        validate(DEMO, ["evaluation.must_beat=[ngram]", "evaluation.measure_speedup=false"])
    assert "evaluation.must_beat" in str(info.value) and "\n" not in str(info.value)


def test_the_baseline_registry():
    assert baseline_configs(["ngram", "suffix"], 3) == {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        "suffix": {"method": "suffix", "num_speculative_tokens": 3},
    }
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_configs(["medusa"], 3)


def test_suffix_without_arctic_inference_is_one_line_naming_the_field(monkeypatch):
    check_available(["ngram"], sys.executable)  # needs nothing
    with pytest.raises(BaselineUnavailable) as info:
        check_available(["suffix"], sys.executable)  # the project's virtualenv has no arctic_inference
    message = str(info.value)
    assert "\n" not in message and "evaluation.must_beat" in message and "arctic-inference" in message
    monkeypatch.setitem(baselines_module.REQUIRES, "suffix", ("json", "json"))
    check_available(["suffix"], sys.executable)


def test_evaluation_fails_before_any_server_when_suffix_cannot_run(smollm2_dir, tmp_path):
    overrides = ["evaluation.must_beat=[suffix]", f"vllm.launch.python={sys.executable}"]
    with pytest.raises(EvaluationError, match=r"^evaluation.must_beat: suffix needs the arctic_inference"):
        evaluate_checkpoint(
            tmp_path, DEMO, overrides=overrides, server_factory=no_server, out_dir=tmp_path / "eval"
        )


@pytest.mark.parametrize(
    "overrides, gate",
    [
        ([], (1.0, [])),  # the defaults: the speed-up must reach 1.0, no baseline
        (["evaluation.min_speedup=1.1", "evaluation.must_beat=[ngram]"], (1.1, ["ngram"])),
        (["evaluation.min_speedup=null"], (None, [])),
    ],
)
def test_the_recipe_sets_the_speed_gate_of_the_evaluation(
    smollm2_dir, tmp_path, monkeypatch, overrides, gate
):
    import draftflow.evaluation.run as run_module

    seen = {}

    def evaluated(checkpoint_dir, prompts, **kwargs):
        seen.update(kwargs)
        ev = Evaluation(None, None, 1.0, 0.1, str(checkpoint_dir), min_speedup=kwargs["min_speedup"])
        return run_module.EvalRun(ev)

    monkeypatch.setattr(run_module, "evaluate_prompts", evaluated)
    python = f"vllm.launch.python={sys.executable}"  # no vLLM is probed
    evaluate_checkpoint(tmp_path, DEMO, overrides=[*overrides, python], server_factory=no_server)
    assert (seen["min_speedup"], list(seen["must_beat"])) == gate
    assert seen["in_vllm"] and seen["measure_baseline"]


def no_server(model, config=None):
    raise AssertionError("no server may start")


# --- the speed rounds with baselines, on stand-in servers -----------------------------------

# seconds per request on each side's stand-in server: the drafter 2x the target, ngram 1.25x
SECONDS = {"drafter": 0.5, "target": 1.0, "ngram": 0.8}


class StandInServer(in_vllm._Server):
    """Answers like a greedy vLLM server: the same tokens on every side (unless told to differ),
    a fixed latency per side, and spec-decode counters on the drafter's side."""

    log: list[str] = []
    differ: dict[str, int] = {}  # side: prompt index whose output differs

    def __init__(self, url: str, timeout_s: float):
        self.url = self.side = url
        self.done = 0

    def complete(self, prompt, max_tokens):
        tokens = [int(t) + 1 for t in prompt][:max_tokens]
        if max_tokens < MAX_NEW_TOKENS:  # the warm-up: untimed
            return tokens, 0.01
        StandInServer.log.append(self.side)
        if self.differ.get(self.side) == self.log.count(self.side) - 1:
            tokens = tokens[:-1] + [0]
        return tokens, SECONDS[self.side]

    def counters(self):
        self.done += 1
        return SpecCounters(self.done, 3 * self.done, 2 * self.done, {0: self.done, 1: self.done})

    def close(self):
        pass


def side_of(model, config):
    if config and "method" in config:
        return config["method"]
    return "target" if model == "the-target" else "drafter"


@pytest.fixture
def stand_in(monkeypatch):
    StandInServer.log, StandInServer.differ = [], {}
    monkeypatch.setattr(in_vllm, "_Server", StandInServer)
    monkeypatch.setattr(
        in_vllm,
        "checkpoint_info",
        lambda folder: {"kind": "dflash", "verifier": "the-target", "speculative_tokens": 3},
    )
    monkeypatch.setattr(in_vllm.time, "sleep", lambda s: None)  # the interleaved schedule's pauses
    configs = []

    @contextmanager
    def factory(model, config=None):
        configs.append((model, config))
        yield side_of(model, config)

    factory.configs = configs
    return factory


PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]  # 5 tokens out each
MAX_NEW_TOKENS = 12  # the warm-up asks for 8


@pytest.mark.parametrize("interleave", [False, True])
def test_baselines_are_more_sides_of_the_same_rounds(stand_in, interleave):
    result = evaluate_in_vllm(
        "/ckpt",
        PROMPTS,
        max_new_tokens=MAX_NEW_TOKENS,
        server_factory=stand_in,
        prompt_names=["a", "b"],
        speed_rounds=3,
        interleave=interleave,
        baselines=["ngram"],
    )
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert ("the-target", ngram) in stand_in.configs  # served on the target, the drafter's k
    t = result.report.throughput
    assert t["speedup"] == pytest.approx(2.0) and t["rounds"] == pytest.approx([2.0] * 3)
    b = t["baselines"]["ngram"]
    assert (
        b["settings"] == ngram
        and b["speedup"] == pytest.approx(1.25)
        and b["rounds"] == pytest.approx([1.25] * 3)
    )
    assert b["tok_s"] == pytest.approx(5 / 0.8) and b["outputs_identical"] == 2 and b["prompts"] == 2
    assert t["prompt_timings"]["ngram"] == {"a": [15, pytest.approx(2.4)], "b": [15, pytest.approx(2.4)]}
    assert set(t["prompt_timings"]) == {"drafter", "target", "ngram"}
    log = StandInServer.log
    if interleave:  # every prompt on every side back to back, the order rotating by prompt and round
        assert log[:6] == ["drafter", "target", "ngram", "target", "ngram", "drafter"]
    else:  # whole passes, rotated by round: D T N, T N D, N D T
        assert log == [
            s
            for s in [
                "drafter",
                "target",
                "ngram",
                "target",
                "ngram",
                "drafter",
                "ngram",
                "drafter",
                "target",
            ]
            for _ in PROMPTS
        ]
    ev = Evaluation(None, result.report, 1.0, 0.1, "/ckpt", min_speedup=1.0, must_beat=["ngram"])
    assert ev.passed_gate
    assert not Evaluation(None, result.report, 1.0, 0.1, "/ckpt", min_speedup=2.5).passed_gate


def test_a_baseline_whose_output_differs_is_named_in_the_notes(stand_in):
    StandInServer.differ = {"ngram": 1}  # ngram's first pass: the second prompt differs
    result = evaluate_in_vllm(
        "/ckpt",
        PROMPTS,
        max_new_tokens=MAX_NEW_TOKENS,
        server_factory=stand_in,
        prompt_names=["a", "b"],
        baselines=["ngram"],
    )
    assert result.report.throughput["baselines"]["ngram"]["outputs_identical"] == 1
    assert any(
        n.startswith("ngram: prompt b: output differs from the target alone") for n in result.report.notes
    )
    assert result.report.outputs_identical == 2  # the drafter's own check is untouched


def test_baselines_need_the_target_side(stand_in):
    with pytest.raises(ValueError, match="measure_baseline"):
        evaluate_in_vllm(
            "/ckpt",
            PROMPTS,
            max_new_tokens=MAX_NEW_TOKENS,
            server_factory=stand_in,
            measure_baseline=False,
            baselines=["ngram"],
        )


def test_prompt_timings_skip_runs_without_request_times():
    timed = {"target": [GenerationRun([[1, 2]], 1.0, None, [1.0])], "old": [GenerationRun([[1]], 1.0)]}
    assert prompt_timings(timed, ["a"]) == {"target": {"a": [2, 1.0]}}
