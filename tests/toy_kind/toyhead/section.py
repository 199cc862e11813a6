"""The recipe's `drafter` section of kind `toyhead`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftflow.recipe.section import MAX_VOCAB, DrafterSection


class ToyHeadSection(DrafterSection):
    """Toy heads: k independent heads on fc(aux states) + the bonus token's embedding."""

    kind: Literal["toyhead"]
    speculative_tokens: int = Field(2, ge=1, le=16, description="Heads, one drafted token each.")
    draft_vocab_size: int | None = Field(512, ge=1, le=MAX_VOCAB)
    context_layer_ids: list[int] | None = None
