"""Decode speed: timed passes, their pooled speed and speed-up over the target alone, and the table.

A *side* is one way of serving the target: ``drafter`` (the checkpoint as its speculative model),
``target`` (no speculation) and the train-free baselines of :mod:`draftflow.evaluation.baselines`
(``ngram``, ``suffix``). Every side decodes the same prompts in the same rounds
(:func:`draftflow.evaluation.in_vllm.decode_rounds`, rotated or interleaved). A side's speed is
its completion tokens over its request time, pooled over the rounds; its speed-up is that over
the target's pooled speed.

The vLLM report's ``throughput`` holds it all::

    with_drafter_tok_s, without_drafter_tok_s, speedup, rounds (each round's speed-up), schedule,
    baselines: {name: {settings, tok_s, speedup, rounds, outputs_identical, prompts}},
    champion: {version, tau, settings, tok_s, speedup, rounds, outputs_identical, prompts}  (a refresh)
    prompt_timings: {side: {prompt id: [completion tokens, seconds]}}  (summed over the rounds)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draftflow.evaluation.in_vllm import SpecCounters

DRAFTER, TARGET = "drafter", "target"
CHAMPION = "champion"  # the drafter in service, raced by a refresh run's new one (the challenger)


@dataclass
class GenerationRun:
    outputs: list[list[int]]
    seconds: float  # sum of request latencies
    per_prompt: list[SpecCounters] | None = None
    prompt_seconds: list[float] = field(default_factory=list)  # each request's latency, prompt order

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds if self.seconds > 0 else 0.0


def rotated_order(sides: Sequence[str], rounds: int, first_round: int = 0) -> list[str]:
    """Which side each server start decodes: round r runs the sides rotated by r (D T, T D, D T,
    ... for two; A B T, B T A, T A B for three), for rounds ``first_round`` onwards. Every round has
    one pass of each side, and over len(sides) rounds each side takes every slot once, so a host
    load that drifts steadily over the measurement weighs on all sides alike."""
    n = len(sides)
    return [sides[(r + i) % n] for r in range(first_round, first_round + rounds) for i in range(n)]


def pooled_tokens_per_s(runs: Sequence[GenerationRun]) -> float:
    """All completion tokens over all request time."""
    return GenerationRun([o for r in runs for o in r.outputs], sum(r.seconds for r in runs)).tokens_per_s


def _ratios(side: Sequence[GenerationRun], target: Sequence[GenerationRun]) -> list[float]:
    return [s.tokens_per_s / t.tokens_per_s if t.tokens_per_s else 0.0 for s, t in zip(side, target)]


def speed_summary(with_drafter: Sequence[GenerationRun], without: Sequence[GenerationRun]) -> dict:
    """Decode speed pooled over the rounds (all completion tokens / all request time, per
    side), their ratio, and each round's own ratio: the spread says how far to trust it."""
    fast, slow = pooled_tokens_per_s(with_drafter), pooled_tokens_per_s(without)
    return {
        "with_drafter_tok_s": fast,
        "without_drafter_tok_s": slow,
        "speedup": fast / slow if slow else 0.0,
        "rounds": _ratios(with_drafter, without),
    }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def later_round_differences(
    with_drafter: Sequence[GenerationRun], without: Sequence[GenerationRun], baseline: Sequence[Sequence[int]]
) -> list[str]:
    """Greedy decoding is deterministic, so every speed pass past the first pair must reproduce
    the target's first outputs; a pass that does not is named (and times different work)."""
    notes = []
    for side, runs in (("with the drafter", with_drafter), ("target alone", without)):
        for n, r in enumerate(runs, start=2):
            differ = sum(a != b for a, b in zip(r.outputs, baseline))
            if differ:
                notes.append(
                    f"speed pass {n} {side}: {differ}/{len(baseline)} outputs differ from the target's first"
                )
    return notes


def baseline_summary(
    name: str,
    settings: dict,
    runs: Sequence[GenerationRun],
    target: Sequence[GenerationRun],
    names: Sequence[str],
) -> tuple[dict, list[str]]:
    """One baseline side: pooled tok/s, speed-up over the target, each round's speed-up, and how
    many of its first pass's outputs equal the target's first (greedy speculation is lossless,
    so every difference becomes a note, as does a later pass that differs)."""
    reference = target[0].outputs
    tok_s, target_tok_s = pooled_tokens_per_s(runs), pooled_tokens_per_s(target)
    same = [a == b for a, b in zip(runs[0].outputs, reference)]
    notes = [
        f"{name}: prompt {n}: output differs from the target alone (first at token "
        f"{first_difference(a, b)}): greedy speculation should be lossless"
        for n, ok, a, b in zip(names, same, runs[0].outputs, reference)
        if not ok
    ]
    for n, r in enumerate(runs[1:], start=2):
        differ = sum(a != b for a, b in zip(r.outputs, reference))
        if differ:
            notes.append(
                f"{name}: speed pass {n}: {differ}/{len(reference)} outputs differ from the target's first"
            )
    summary = {
        "settings": dict(settings),
        "tok_s": tok_s,
        "speedup": tok_s / target_tok_s if target_tok_s else 0.0,
        "rounds": _ratios(runs, target),
        "outputs_identical": sum(same),
        "prompts": len(reference),
    }
    return summary, notes


def prompt_timings(timed: dict[str, Sequence[GenerationRun]], names: Sequence[str]) -> dict[str, dict]:
    """{side: {prompt id: [completion tokens, seconds]}}, summed over the side's passes; sides
    whose passes carry no per-request times are left out."""
    out: dict[str, dict] = {}
    for side, runs in timed.items():
        if not runs or any(len(r.prompt_seconds) != len(r.outputs) for r in runs):
            continue
        rows = {n: [0, 0.0] for n in names}
        for r in runs:
            for n, tokens, seconds in zip(names, r.outputs, r.prompt_seconds):
                rows[n][0] += len(tokens)
                rows[n][1] += seconds
        out[side] = rows
    return out


# ---------------------------------------------------------------------------------------
# The table (report.md and the model card)
# ---------------------------------------------------------------------------------------


def _sides(throughput: dict) -> list[tuple[str, str, float]]:
    """(side key, label, pooled tok/s): the target, each baseline, the drafter."""
    rows = [(TARGET, "target alone", throughput["without_drafter_tok_s"])]
    for name, b in (throughput.get("baselines") or {}).items():
        k = (b.get("settings") or {}).get("num_speculative_tokens")
        rows.append((name, f"{name} (train-free{f', k={k}' if k else ''})", b["tok_s"]))
    rows.append((DRAFTER, "drafter", throughput["with_drafter_tok_s"]))
    return rows


def speed_table(throughput: dict, categories: dict[str, str] | None = None) -> list[str]:
    """Markdown lines: tok/s and speed-up over the target of each side; with ``categories``
    ({prompt id: category}) and per-prompt timings, a second table per category."""
    sides = _sides(throughput)
    target = throughput["without_drafter_tok_s"]
    lines = ["| decoding | tok/s | speed-up over the target |", "|---|---|---|"]
    for _, label, tok_s in sides:
        lines.append(f"| {label} | {tok_s:.1f} | {tok_s / target if target else 0.0:.2f}x |")
    timings = throughput.get("prompt_timings") or {}
    if not categories or TARGET not in timings:
        return lines
    shown = [(key, label) for key, label, _ in sides if key in timings]
    lines += [
        "",
        "Per prompt category (tok/s, speed-up over the target alone):",
        "",
        "| category | prompts | " + " | ".join(label for _, label in shown) + " |",
        "|---|---|" + "---|" * len(shown),
    ]
    for cat in sorted(set(categories.values())):
        ids = [p for p in timings[TARGET] if categories.get(p) == cat]
        if not ids:
            continue
        speed = {key: _tok_s(timings[key], ids) for key, _ in shown}
        cells = [
            f"{speed[key]:.1f}"
            if key == TARGET
            else f"{speed[key]:.1f} ({_ratio(speed[key], speed[TARGET])})"
            for key, _ in shown
        ]
        lines.append(f"| {cat} | {len(ids)} | " + " | ".join(cells) + " |")
    return lines


def _tok_s(rows: dict, ids: Sequence[str]) -> float:
    tokens = sum(rows[p][0] for p in ids if p in rows)
    seconds = sum(rows[p][1] for p in ids if p in rows)
    return tokens / seconds if seconds > 0 else 0.0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "–"
