"""The `refresh` section: how a scheduled run on new traffic improves on the drafter in service."""

from __future__ import annotations

from pydantic import Field, FiniteFloat

from draftflow.recipe.section import MAX_COUNT, Section


class RefreshSection(Section):
    """Continual refresh: warm start from the drafter in service, replay earlier data, and publish
    only a drafter that beats it (the champion) on the newest traffic's held-out conversations."""

    warm_start: bool = Field(
        True,
        description="Start from the weights of the drafter the destination's release pointer names "
        "(its draft vocabulary too; the optimizer starts fresh). The first run, with none published, "
        "trains from scratch.",
    )
    epochs: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Epochs of a warm-started run (a shorter schedule of its own); None: training.epochs.",
    )
    replay: FiniteFloat = Field(
        0.25,
        ge=0,
        le=1,
        description="Fraction of the earlier segments' training samples mixed into the run (seeded), so "
        "the drafter does not forget; 0: the newest segment only.",
    )
    min_gain_acceptance: FiniteFloat = Field(
        0.02,
        ge=-10,
        le=10,
        description="Publish only when the new drafter's τ is at least the champion's plus this, "
        "measured in the same vLLM rounds on the newest segment's held-out conversations.",
    )
    min_gain_speedup: FiniteFloat = Field(
        0.0,
        ge=-10,
        le=10,
        description="... and its decode speed-up over the target at least the champion's plus this "
        "(when the speed-up is measured).",
    )
