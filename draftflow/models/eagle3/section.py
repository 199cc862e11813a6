"""The recipe's `drafter` section of kind `eagle3` (pydantic only: recipes validate without torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, FiniteFloat

from draftflow.recipe.section import MAX_VOCAB, DrafterSection


class Eagle3Section(DrafterSection):
    """Eagle3: an autoregressive one-layer drafter trained with training-time test."""

    kind: Literal["eagle3"]
    ttt_steps: int = Field(3, ge=1, le=16, description="Unrolled steps during training.")
    ttt_decay: FiniteFloat = Field(0.8, gt=0, le=1, description="Loss weight of step k: decay**k.")
    draft_vocab_size: int | None = Field(32000, ge=1, le=MAX_VOCAB)
    speculative_tokens: int = Field(3, ge=1, le=64, description="Chain length when served.")
    context_layer_ids: list[int] | None = Field(
        None, description="Extracted layers the drafter reads; default: all but the last layer L."
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each TTT step (layer, then head and loss) in backward: a step keeps only its "
        "output and keys for backward, so long packs fit (tests/models/test_eagle3_step_checkpointing.py).",
    )
