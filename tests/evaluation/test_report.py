"""The report schema: numbers, JSON roundtrip, markdown, chart, gate, agreement; metric parsing."""

from __future__ import annotations

import json
import struct

import pytest

from draftflow.evaluation.in_vllm import (
    GenerationRun,
    SpecDecodeMetricsMissing,
    decode_rounds,
    evaluate_in_vllm,
    later_round_differences,
    parse_spec_counters,
    rotated_order,
    speed_summary,
)
from draftflow.evaluation.report import AcceptanceReport, Evaluation, PromptAcceptance, rounds_text


def report(source: str, drafts: int, accepted: int, per_pos: list[int], k: int = 3) -> AcceptanceReport:
    return AcceptanceReport(
        source=source,
        drafter="dflash",
        draft_length=k,
        num_prompts=2,
        drafts=drafts,
        draft_tokens=drafts * k,
        accepted_tokens=accepted,
        accepted_per_position=per_pos,
        max_new_tokens=32,
        outputs_identical=2,
        per_prompt=[
            PromptAcceptance("a", drafts - 5, accepted, 32, (drafts - 5) * k, per_pos),
            PromptAcceptance("b", 5, 0, 6, 5 * k, [0] * k),
        ],
        notes=["a note"],
    )


def evaluation(offline_accepted=30, vllm_accepted=30, minimum=1.2, tolerance=0.1) -> Evaluation:
    return Evaluation(
        report("offline", 20, offline_accepted, [12, 10, 8]),
        report("vllm", 20, vllm_accepted, [12, 10, 8]),
        minimum,
        tolerance,
        "/ckpt",
        contract_problems=[],
        meta={"recipe": "r", "prompt_ids": ["a", "b"]},
    )


def test_numbers_follow_vllm_definitions():
    r = report("vllm", 20, 30, [12, 10, 8])
    assert r.mean_acceptance_length == 1 + 30 / 20
    assert r.acceptance_rate == 30 / 60
    assert r.per_position == [12 / 20, 10 / 20, 8 / 20]
    assert r.per_prompt[0].acceptance_length == 1 + 30 / 15 and r.per_prompt[1].acceptance_length == 1.0


def test_json_roundtrip(tmp_path):
    ev = evaluation()
    ev.vllm.throughput = {"with_drafter_tok_s": 20.0, "without_drafter_tok_s": 10.0, "speedup": 2.0}
    ev.contract_problems = ["something is off"]
    back = Evaluation.from_dict(json.loads(json.dumps(ev.to_dict())))
    assert back == ev
    assert back.to_dict() == ev.to_dict()


def test_markdown_png_and_json_are_written(tmp_path):
    ev = evaluation()
    ev.vllm.throughput = {"with_drafter_tok_s": 20.0, "without_drafter_tok_s": 10.0, "speedup": 2.0}
    paths = ev.write(tmp_path / "eval")
    assert json.loads(paths["report"].read_text())["tau"] == pytest.approx(2.5)
    md = paths["summary"].read_text()
    assert "| offline | 2 | 20 | 2.500 | 0.500 | 0.600 | 0.500 | 0.400 |" in md
    assert "speedup 2.00x" in md and "Gate: τ 2.500 vs minimum 1.200: PASS" in md and "agree" in md
    png = paths["chart"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    width, height = struct.unpack(">II", png[16:24])  # IHDR
    assert (width, height) == (600, 350)


def test_chart_without_reports_is_still_a_png(tmp_path):
    ev = Evaluation(None, None, 1.5, 0.1, "/ckpt", contract_problems=["layer ids shifted"])
    paths = ev.write(tmp_path)
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "- layer ids shifted" in paths["summary"].read_text() and not ev.publishable


def test_gate_pass_and_fail():
    assert evaluation(minimum=2.5).passed_gate  # τ = 2.5 exactly meets the minimum
    failed = evaluation(minimum=2.6)
    assert not failed.passed_gate and not failed.publishable
    assert "FAIL" in failed.markdown()
    assert evaluation(minimum=1.0).publishable


def test_gate_uses_vllm_when_measured_else_offline():
    ev = evaluation(offline_accepted=40, vllm_accepted=38, minimum=2.95)
    assert ev.tau == pytest.approx(1 + 38 / 20) and not ev.passed_gate
    ev.vllm = None
    assert ev.tau == pytest.approx(3.0) and ev.passed_gate


def test_disagreement_names_both_numbers():
    ev = evaluation(offline_accepted=30, vllm_accepted=20, tolerance=0.1)  # τ 2.5 vs 2.0: gap 20%
    assert not ev.agrees
    message = ev.disagreement()
    assert (
        "offline τ 2.5000" in message
        and "vLLM τ 2.0000" in message
        and "20.0%" in message
        and "10.0%" in message
    )
    assert evaluation(offline_accepted=30, vllm_accepted=28).disagreement() is None  # τ 2.5 vs 2.4: 4%


METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m/SmolLM2"} 12.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/m/SmolLM2"} 1.76e+09
vllm:spec_decode_num_drafts_total{engine="1",model_name="/m/SmolLM2"} 3.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m/SmolLM2"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m/SmolLM2"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/SmolLM2",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/m/SmolLM2",position="0"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/SmolLM2",position="2"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/m/SmolLM2",position="2"} 1.76e+09
vllm:num_requests_running{engine="0",model_name="/m/SmolLM2"} 0.0
"""


def test_prometheus_counters_summed_over_label_sets_without_created_samples():
    c = parse_spec_counters(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted) == (15, 45, 20)
    assert c.per_position(3) == [10, 0, 4]
    delta = c - parse_spec_counters(METRICS.replace(" 12.0", " 10.0"))
    assert (delta.drafts, delta.accepted, delta.per_position(3)) == (2, 0, [0, 0, 0])


def test_server_without_drafter_has_no_counters():
    with pytest.raises(SpecDecodeMetricsMissing, match="runs no drafter"):
        parse_spec_counters('vllm:num_requests_running{engine="0"} 0.0\n')


def test_speed_rounds_rotate_which_side_goes_first():
    assert rotated_order([True, False], 1) == [True, False]
    assert rotated_order([True, False], 3) == [True, False, False, True, True, False]
    # every round decodes once on each side
    order = rotated_order([True, False], 4)
    assert [sorted(order[i : i + 2]) for i in range(0, 8, 2)] == [[False, True]] * 4
    # three sides: over three rounds each side takes every slot once
    order = rotated_order(["a", "b", "t"], 3)
    assert order == ["a", "b", "t", "b", "t", "a", "t", "a", "b"]
    assert all(sorted(order[slot::3]) == ["a", "b", "t"] for slot in range(3))
    # a later stretch of the same rotation
    assert rotated_order(["a", "b", "t"], 2, first_round=1) == order[3:]


def no_server(model, config=None):
    raise AssertionError("no server is started for a refused request")


def test_an_interleaved_round_cannot_reuse_a_first_pass():
    first = GenerationRun([[1]], 1.0)
    with pytest.raises(ValueError, match="interleaved"):
        decode_rounds(
            no_server, {"d": ("m", None), "t": ("m", None)}, [[1]], 4, 1, first=first, interleave=True
        )


def test_speed_is_pooled_over_rounds_and_each_round_is_kept():
    # round 1: 100 tokens in 2 s with, 100 in 4 s without (2x); round 2: 50 in 2 s vs 50 in 2 s (1x)
    with_drafter = [GenerationRun([[1] * 60, [2] * 40], 2.0), GenerationRun([[3] * 50], 2.0)]
    without = [GenerationRun([[1] * 100], 4.0), GenerationRun([[3] * 50], 2.0)]
    t = speed_summary(with_drafter, without)
    assert t["with_drafter_tok_s"] == pytest.approx(150 / 4.0)
    assert t["without_drafter_tok_s"] == pytest.approx(150 / 6.0)
    assert t["speedup"] == pytest.approx(1.5)
    assert t["rounds"] == pytest.approx([2.0, 1.0])
    assert rounds_text(t) == ", pooled over 2 alternating rounds: 2.00x / 1.00x"
    assert rounds_text(speed_summary(with_drafter[:1], without[:1])) == ""
    assert rounds_text(dict(t, schedule="interleaved")) == ", pooled over 2 interleaved rounds: 2.00x / 1.00x"
    one = dict(speed_summary(with_drafter[:1], without[:1]), schedule="interleaved")
    assert rounds_text(one) == ", interleaved: both servers up, each prompt on both in turn"


def test_an_interleaved_evaluation_needs_the_target_side():
    with pytest.raises(ValueError, match="measure_baseline"):
        evaluate_in_vllm(
            "unused",
            [[1]],
            max_new_tokens=4,
            server_factory=no_server,
            measure_baseline=False,
            interleave=True,
        )


def test_markdown_names_the_rounds_of_a_pooled_speedup(tmp_path):
    ev = evaluation()
    ev.vllm.throughput = {
        "with_drafter_tok_s": 30.0,
        "without_drafter_tok_s": 20.0,
        "speedup": 1.5,
        "rounds": [1.4, 1.6, 1.5],
    }
    md = ev.write(tmp_path / "eval")["summary"].read_text()
    assert "speedup 1.50x, pooled over 3 alternating rounds: 1.40x / 1.60x / 1.50x)." in md


def test_later_speed_passes_must_reproduce_the_targets_first_outputs():
    baseline = [[1, 2, 3], [4, 5]]
    same = GenerationRun([[1, 2, 3], [4, 5]], 1.0)
    assert later_round_differences([same, same], [same], baseline) == []
    drifted = GenerationRun([[1, 2, 3], [4, 6]], 1.0)
    notes = later_round_differences([same, drifted], [drifted], baseline)
    assert notes == [
        "speed pass 3 with the drafter: 1/2 outputs differ from the target's first",
        "speed pass 2 target alone: 1/2 outputs differ from the target's first",
    ]
