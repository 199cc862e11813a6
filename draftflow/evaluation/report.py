"""The acceptance report: one schema for the offline simulator and for vLLM's counters.

τ (mean acceptance length) = tokens produced per target forward pass
                           = 1 + accepted draft tokens / drafts.
Per-position acceptance i  = fraction of drafts whose first i+1 tokens were all accepted.

Counting follows vLLM's scheduler: one draft per verification step, and accepted tokens are
counted in full even when they run past ``max_new_tokens`` or an EOS (the output is cut
afterwards). Both evaluators fill the same fields, so the two reports compare field by field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftflow.evaluation.categories import (
    category_markdown,
    draw_categories,
    evaluation_categories,
)
from draftflow.evaluation.speed import speed_table


@dataclass
class PromptAcceptance:
    prompt_id: str
    drafts: int
    accepted: int
    generated_tokens: int
    draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


def rounds_text(throughput: dict) -> str:
    """How the speed-up was timed: interleaved (both servers up, each prompt on both back to back)
    or not, and for more than one round how many were pooled and each one's speed-up."""
    rounds = throughput.get("rounds") or []
    interleaved = throughput.get("schedule") == "interleaved"
    how = "interleaved" if interleaved else "alternating"
    if len(rounds) < 2:
        return ", interleaved: both servers up, each prompt on both in turn" if interleaved else ""
    return f", pooled over {len(rounds)} {how} rounds: " + " / ".join(f"{r:.2f}x" for r in rounds)


@dataclass
class AcceptanceReport:
    source: str  # "offline" | "vllm"
    drafter: str  # "dflash" | "eagle3"
    draft_length: int  # speculative tokens per draft
    num_prompts: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    per_prompt: list[PromptAcceptance] = field(default_factory=list)
    throughput: dict | None = None  # tokens/s with and without the drafter, speedup
    notes: list[str] = field(default_factory=list)
    max_new_tokens: int | None = None
    # Prompts whose output equals the reference: the target's plain greedy output (offline),
    # the same server without the drafter (vLLM, when throughput was measured); None: not compared.
    outputs_identical: int | None = None

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mean_acceptance_length"] = self.mean_acceptance_length
        out["acceptance_rate"] = self.acceptance_rate
        out["per_position_acceptance"] = self.per_position
        for p, src in zip(out["per_prompt"], self.per_prompt):
            p["acceptance_length"] = src.acceptance_length
        return out

    @classmethod
    def from_dict(cls, data: dict) -> AcceptanceReport:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["per_prompt"] = [
            PromptAcceptance(**{k: v for k, v in p.items() if k in PromptAcceptance.__dataclass_fields__})
            for p in data.get("per_prompt", [])
        ]
        return cls(**fields)


@dataclass
class Evaluation:
    """Both reports, the agreement check and the gate: what `evaluate` writes to the run folder.

    The gate: τ ≥ ``min_acceptance_length``; and, when vLLM measured the decode speed-up over the
    target alone, speed-up ≥ ``min_speedup`` (None: not gated) and speed-up > each ``must_beat``
    baseline's, measured in the same rounds. Without a measured speed-up only τ is gated
    (:meth:`speed_gate_note` says so)."""

    offline: AcceptanceReport | None
    vllm: AcceptanceReport | None
    min_acceptance_length: float
    agreement_tolerance: float
    checkpoint: str
    contract_problems: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # recipe, fingerprint, target, prompt ids, max_new_tokens
    # sha256 of the checkpoint measured (draftflow.models.speculators.checkpoint_digest): publishing
    # refuses a folder whose bytes differ from what this report is about.
    checkpoint_digest: str | None = None
    # the speed gate (evaluation.min_speedup, evaluation.must_beat); reports older than it: off
    min_speedup: float | None = None
    must_beat: list[str] = field(default_factory=list)
    # a refresh run (recipe `refresh`): {"acceptance", "speedup"}, the margins by which this drafter
    # (the challenger) must beat the one in service (the champion), measured beside it
    champion_margins: dict | None = None

    @property
    def tau(self) -> float:
        report = self.vllm or self.offline
        return report.mean_acceptance_length if report else 1.0

    @property
    def relative_gap(self) -> float | None:
        if not (self.offline and self.vllm):
            return None
        a, b = self.offline.mean_acceptance_length, self.vllm.mean_acceptance_length
        return abs(a - b) / max(a, b)

    @property
    def agrees(self) -> bool:
        gap = self.relative_gap
        return gap is None or gap <= self.agreement_tolerance

    @property
    def speedup(self) -> float | None:
        """The drafter's pooled decode speed-up over the target alone in vLLM; None: not measured."""
        throughput = self.vllm.throughput if self.vllm else None
        return throughput.get("speedup") if throughput else None

    @property
    def baselines(self) -> dict[str, dict]:
        """{name: speed of the train-free baseline measured beside the drafter} (see speed.py)."""
        throughput = self.vllm.throughput if self.vllm else None
        return dict((throughput or {}).get("baselines") or {})

    @property
    def champion(self) -> dict | None:
        """The drafter in service as measured beside this one (speed.py), on a refresh run that has one."""
        throughput = self.vllm.throughput if self.vllm else None
        return (throughput or {}).get("champion")

    def champion_failures(self) -> list[str]:
        """Why this drafter does not beat the champion by the recipe's margins; empty: it does, or
        there is no champion (a first refresh: the usual gate alone)."""
        champion = self.champion
        if self.champion_margins is None or champion is None:
            return []
        failures = []
        gain, version = self.champion_margins["acceptance"], champion["version"]
        if not self.tau >= champion["tau"] + gain:
            failures.append(
                f"τ {self.tau:.3f} does not beat the champion's ({version}) τ {champion['tau']:.3f} by "
                f"refresh.min_gain_acceptance {gain}"
            )
        speedup, gain = self.speedup, self.champion_margins["speedup"]
        if speedup is not None and not speedup >= champion["speedup"] + gain:
            a, b = _pair(speedup, champion["speedup"])
            failures.append(
                f"speed-up {a} does not beat the champion's ({version}) {b} by refresh.min_gain_speedup {gain}"
            )
        return failures

    def gate_failures(self) -> list[str]:
        """Each reason the gate fails, one line naming the numbers; empty: passed."""
        failures = self.champion_failures()
        if self.tau < self.min_acceptance_length:
            failures.append(
                f"τ {self.tau:.3f} < evaluation.min_acceptance_length {self.min_acceptance_length}"
            )
        speedup = self.speedup
        if speedup is None:
            return failures
        if self.min_speedup is not None and speedup < self.min_speedup:
            a, b = _pair(speedup, self.min_speedup)
            failures.append(f"speed-up {a} over the target is below evaluation.min_speedup {b}")
        for name in self.must_beat:
            other = self.baselines.get(name)
            if other is None:
                failures.append(
                    f"{name} was not measured beside the drafter, so the speed-up {speedup:.2f}x cannot "
                    "be compared with it (evaluation.must_beat): evaluate again"
                )
            elif not speedup > other["speedup"]:
                a, b = _pair(speedup, other["speedup"])
                failures.append(f"speed-up {a} does not beat {name}'s {b} (evaluation.must_beat)")
        return failures

    def speed_gate_note(self) -> str | None:
        """Why the speed gate did not run, when it is set but vLLM measured no speed-up."""
        if self.speedup is None and (self.min_speedup is not None or self.must_beat):
            return "speed-up not measured: not gated (evaluation.in_vllm and evaluation.measure_speedup measure it)"
        return None

    @property
    def passed_gate(self) -> bool:
        return not self.gate_failures()

    @property
    def publishable(self) -> bool:
        """Gate passed, evaluators agree, checkpoint matches its provenance."""
        return self.passed_gate and self.agrees and not self.contract_problems

    def disagreement(self) -> str | None:
        """Why offline and vLLM τ disagree beyond the tolerance (both numbers), or None."""
        if self.agrees:
            return None
        a, b = self.offline.mean_acceptance_length, self.vllm.mean_acceptance_length
        return (
            f"offline τ {a:.4f} and vLLM τ {b:.4f} disagree: relative gap {self.relative_gap:.1%} exceeds the "
            f"tolerance {self.agreement_tolerance:.1%} ({self.checkpoint})"
        )

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "checkpoint_digest": self.checkpoint_digest,
            "offline": self.offline.to_dict() if self.offline else None,
            "vllm": self.vllm.to_dict() if self.vllm else None,
            "tau": self.tau,
            "relative_gap": self.relative_gap,
            "agreement_tolerance": self.agreement_tolerance,
            "agrees": self.agrees,
            "min_acceptance_length": self.min_acceptance_length,
            "min_speedup": self.min_speedup,
            "must_beat": list(self.must_beat),
            "champion_margins": self.champion_margins,
            "speedup": self.speedup,
            "passed_gate": self.passed_gate,
            "gate_failures": self.gate_failures(),
            "speed_gate_note": self.speed_gate_note(),
            "contract_problems": list(self.contract_problems),
            "publishable": self.publishable,
            "meta": self.meta,
            "per_category": evaluation_categories(self),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Evaluation:
        return cls(
            offline=AcceptanceReport.from_dict(data["offline"]) if data.get("offline") else None,
            vllm=AcceptanceReport.from_dict(data["vllm"]) if data.get("vllm") else None,
            min_acceptance_length=data["min_acceptance_length"],
            agreement_tolerance=data["agreement_tolerance"],
            checkpoint=data["checkpoint"],
            contract_problems=list(data.get("contract_problems") or []),
            meta=dict(data.get("meta") or {}),
            checkpoint_digest=data.get("checkpoint_digest"),
            min_speedup=data.get("min_speedup"),
            must_beat=list(data.get("must_beat") or []),
            champion_margins=data.get("champion_margins"),
        )

    def markdown(self) -> str:
        rows = [r for r in (self.offline, self.vllm) if r]
        k = max((r.draft_length for r in rows), default=0)
        head = (
            "| measured in | prompts | drafts | τ (mean acceptance length) | acceptance rate | "
            + " | ".join(f"pos {i + 1}" for i in range(k))
            + " |"
        )
        sep = "|" + "---|" * (5 + k)
        lines = [f"# Acceptance of {self.checkpoint}", ""]
        if self.meta:
            shown = {k: v for k, v in self.meta.items() if not isinstance(v, (list, dict))}
            lines += [", ".join(f"{k}: {v}" for k, v in shown.items()), ""]
        if self.contract_problems:
            lines += ["Contract problems (checkpoint vs its training provenance):", ""]
            lines += [f"- {p}" for p in self.contract_problems] + [""]
        lines += [head, sep]
        for r in rows:
            pos = " | ".join(f"{p:.3f}" for p in r.per_position)
            lines.append(
                f"| {r.source} | {r.num_prompts} | {r.drafts} | {r.mean_acceptance_length:.3f} | "
                f"{r.acceptance_rate:.3f} | {pos} |"
            )
        notes = []
        for r in rows:
            if r.outputs_identical is not None:
                notes.append(
                    f"- {r.source}: {r.outputs_identical}/{r.num_prompts} outputs identical to the target's "
                    "own greedy output" + (" (same server, no drafter)" if r.source == "vllm" else "")
                )
            notes += [f"- {r.source}: {note}" for note in r.notes]
        lines += [""] + notes if notes else []
        lines += category_markdown(self)
        lines += self._per_prompt_table(rows)
        if self.vllm and self.vllm.throughput:
            t = self.vllm.throughput
            lines += [
                "",
                f"Decode throughput in vLLM (batch size 1, completion tokens / request time): "
                f"{t['with_drafter_tok_s']:.1f} tok/s with the drafter, "
                f"{t['without_drafter_tok_s']:.1f} tok/s without (speedup {t['speedup']:.2f}x"
                + rounds_text(t)
                + ").",
                "",
                *speed_table(t, self.meta.get("prompt_categories")),
            ]
        gap = self.relative_gap
        if gap is not None:
            lines += [
                "",
                f"Offline vs vLLM τ gap: {gap:.1%} (tolerance {self.agreement_tolerance:.1%}): "
                + ("agree" if self.agrees else "DISAGREE"),
            ]
        lines += ["", *self.gate_lines()]
        return "\n".join(lines) + "\n"

    def gate_lines(self) -> list[str]:
        """One line per gate: τ, the speed-up's minimum, each baseline to beat (or why not gated)."""
        verdict = {True: "PASS", False: "FAIL"}
        lines = [
            f"Gate: τ {self.tau:.3f} vs minimum {self.min_acceptance_length:.3f}: "
            + verdict[self.tau >= self.min_acceptance_length]
        ]
        champion = self.champion if self.champion_margins is not None else None
        if champion is not None:
            gain = self.champion_margins["acceptance"]
            lines.append(
                f"Gate: τ {self.tau:.3f} vs the champion's ({champion['version']}) {champion['tau']:.3f} "
                f"+ {gain}: {verdict[self.tau >= champion['tau'] + gain]}"
            )
        speedup, note = self.speedup, self.speed_gate_note()
        if note:
            return [*lines, f"Gate: {note}"]
        if champion is not None and speedup is not None:
            gain = self.champion_margins["speedup"]
            a, b = _pair(speedup, champion["speedup"])
            lines.append(
                f"Gate: speed-up {a} vs the champion's {b} + {gain}: {verdict[speedup >= champion['speedup'] + gain]}"
            )
        if speedup is None:
            return lines
        if self.min_speedup is not None:
            a, b = _pair(speedup, self.min_speedup)
            lines.append(f"Gate: speed-up {a} vs minimum {b}: {verdict[speedup >= self.min_speedup]}")
        for name in self.must_beat:
            other = self.baselines.get(name)
            if other is None:
                lines.append(f"Gate: speed-up {speedup:.2f}x vs {name}: not measured: FAIL")
            else:
                a, b = _pair(speedup, other["speedup"])
                lines.append(f"Gate: speed-up {a} vs {name}'s {b}: {verdict[speedup > other['speedup']]}")
        return lines

    @staticmethod
    def _per_prompt_table(rows: list[AcceptanceReport]) -> list[str]:
        """τ and generated tokens per prompt, one column pair per evaluator."""
        if not rows or not rows[0].per_prompt:
            return []
        by_source = [{p.prompt_id: p for p in r.per_prompt} for r in rows]
        lines = [
            "",
            "| prompt | " + " | ".join(f"{r.source} τ | {r.source} tokens" for r in rows) + " |",
            "|---|" + "---|---|" * len(rows),
        ]
        for p in rows[0].per_prompt:
            cells = [
                (f"{d[p.prompt_id].acceptance_length:.3f}", str(d[p.prompt_id].generated_tokens))
                if p.prompt_id in d
                else ("", "")
                for d in by_source
            ]
            lines.append(f"| {p.prompt_id} | " + " | ".join(f"{a} | {b}" for a, b in cells) + " |")
        return lines

    def write(self, folder: Path) -> dict[str, Path]:
        folder.mkdir(parents=True, exist_ok=True)
        paths = {
            "report": folder / "report.json",
            "summary": folder / "report.md",
            "chart": folder / "acceptance.png",
        }
        paths["report"].write_text(json.dumps(self.to_dict(), indent=2))
        paths["summary"].write_text(self.markdown())
        acceptance_chart([r for r in (self.offline, self.vllm) if r], paths["chart"], evaluation=self)
        return paths


def _pair(a: float, b: float) -> tuple[str, str]:
    """Two speed-ups as ``1.23x``, with more decimals where two would show them equal."""
    digits = next((d for d in (2, 3, 4) if f"{a:.{d}f}" != f"{b:.{d}f}"), 4)
    return f"{a:.{digits}f}x", f"{b:.{digits}f}x"


def acceptance_chart(
    reports: list[AcceptanceReport], path: Path, evaluation: Evaluation | None = None
) -> Path:
    """Per-position acceptance; with prompt categories, a second panel of τ per category."""
    from matplotlib.figure import Figure  # not pyplot: drawn in task threads (see train/curves.py)
    from matplotlib.ticker import MaxNLocator

    with_categories = evaluation is not None and bool(evaluation_categories(evaluation))
    panels, width_in = (2, 11) if with_categories else (1, 6)
    fig = Figure(figsize=(width_in, 3.5), dpi=100)
    axes = fig.subplots(1, panels)
    ax = axes[0] if with_categories else axes
    if with_categories:
        draw_categories(axes[1], evaluation)
    width = 0.8 / max(1, len(reports))
    for j, r in enumerate(reports):
        xs = [i + 1 + (j - (len(reports) - 1) / 2) * width for i in range(r.draft_length)]
        ax.bar(xs, r.per_position, width=width, label=f"{r.source} (τ={r.mean_acceptance_length:.2f})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # draft positions are 1, 2, ... k
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (prefix accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance")
    if reports:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "not evaluated", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    return path
