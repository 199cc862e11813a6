"""The recipe's `drafter` section of kind `dflash` (pydantic only: recipes validate without torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, FiniteFloat, ValidationInfo, field_validator, model_validator

from draftflow.recipe.section import MAX_TOKENS, MAX_VOCAB, DrafterSection


class DFlashSection(DrafterSection):
    """DFlash: a block-diffusion drafter that drafts up to `block_size - 1` tokens per forward pass."""

    kind: Literal["dflash"]
    block_size: int = Field(8, ge=2, le=1024)
    speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=1023,
        description="Tokens drafted per step when served, 1..block_size - 1 (None: block_size - 1). Each "
        "costs a verification slot in every decode step: bench/quality.py --draft-lengths.",
    )
    max_anchors: int = Field(512, ge=1, le=MAX_TOKENS, description="Blocks sampled per packed sequence.")
    num_layers: int = Field(1, ge=1, le=256)
    draft_vocab_size: int | None = Field(
        None, ge=1, le=MAX_VOCAB, description="Reduced output vocabulary; None keeps the target's."
    )
    loss_decay_gamma: FiniteFloat | None = Field(
        None, gt=0, le=1e6, description="w_k = exp(-(k-1)/gamma); default 4 for B<=8, 7 above."
    )
    mask_token_id: int | None = Field(
        None, ge=0, le=MAX_VOCAB, description="Default: the tokenizer's mask or pad token."
    )
    context_layer_ids: list[int] | None = Field(
        None, description="Extracted layers the drafter reads; default: all but the last layer L."
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer in backward: far less memory at many anchors "
        "for a longer step (docs/benchmarks.md, GPU training step; bench/gpu.py).",
    )
    init_from_target: bool = Field(
        False, description="Start the decoder layers from the target's last ones, not random weights."
    )

    @field_validator("speculative_tokens", mode="before")
    @classmethod
    def _whole_block_by_default(cls, value: object, info: ValidationInfo) -> object:
        # block_size is validated before this field (declaration order) and absent when invalid,
        # then its own error is reported; validate_default runs this for an omitted value too.
        if value is None and "block_size" in info.data:
            return info.data["block_size"] - 1
        return value

    @model_validator(mode="after")
    def _served_length(self) -> DFlashSection:
        if self.speculative_tokens is not None and self.speculative_tokens > self.block_size - 1:
            raise ValueError(
                f"speculative_tokens {self.speculative_tokens} exceeds block_size - 1 = "
                f"{self.block_size - 1} (a block drafts at most that many)"
            )
        return self

    @property
    def decay_gamma(self) -> float:
        if self.loss_decay_gamma is not None:
            return self.loss_decay_gamma
        return 4.0 if self.block_size <= 8 else 7.0
