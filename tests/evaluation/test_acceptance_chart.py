"""The acceptance chart's x axis shows draft positions 1..k: whole numbers only."""

from __future__ import annotations

from pathlib import Path

import matplotlib.figure

from draftflow.evaluation.report import AcceptanceReport, acceptance_chart


def report(source: str, k: int) -> AcceptanceReport:
    accepted = [max(0, 40 - 12 * i) for i in range(k)]
    return AcceptanceReport(
        source=source,
        drafter="dflash",
        draft_length=k,
        num_prompts=2,
        drafts=50,
        draft_tokens=50 * k,
        accepted_tokens=sum(accepted),
        accepted_per_position=accepted,
    )


def test_draft_positions_on_the_x_axis_are_integers(tmp_path: Path, monkeypatch):
    drawn = []
    save = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    for k in (3, 7):
        path = acceptance_chart([report("offline", k), report("vllm", k)], tmp_path / f"k{k}.png")
        assert path.stat().st_size > 0
        ax = drawn[-1].axes[0]
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
