"""DFlash drafter configuration, and how it is derived from the target and the tokenizer."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from draftflow.models.target_weights import rope_theta


@dataclass
class DFlashConfig:
    hidden_size: int  # = the target's hidden size (the drafter reuses its embeddings)
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # rows of lm_head (== vocab_size when not reduced)
    num_context_layers: int  # target layers concatenated into the fused context
    block_size: int  # B: anchor + B-1 mask slots; vLLM drafts B-1 tokens
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocab [0, {self.vocab_size})")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError("draft_vocab_size exceeds vocab_size")

    @property
    def speculative_tokens(self) -> int:
        return self.block_size - 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        num_context_layers: int,
        draft_vocab_size: int | None = None,
    ) -> DFlashConfig:
        """Decoder-layer shapes copied from the target (as in the published DFlash drafters)."""
        hidden = int(target_config["hidden_size"])
        heads = int(target_config["num_attention_heads"])
        vocab = int(target_config["vocab_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(target_config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(target_config.get("num_key_value_heads") or heads),
            head_dim=int(target_config.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab_size or vocab,
            num_context_layers=num_context_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(target_config),
            max_position_embeddings=int(target_config.get("max_position_embeddings", 32768)),
        )


def resolve_mask_token_id(
    tokenizer=None, *, override: int | None = None, reserved_id: int | None = None
) -> int:
    """The token whose (frozen, target) embedding fills the B-1 mask slots of a block.

    Order: an explicit ``override`` (recipe ``drafter.mask_token_id``), the tokenizer's mask
    token, its pad token, then ``reserved_id`` chosen by the caller. The id is written to
    the checkpoint (``mask_token_id``) and vLLM feeds exactly that id to the mask slots.
    """
    if override is not None:
        return int(override)
    for attr in ("mask_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    if reserved_id is not None:
        return int(reserved_id)
    raise ValueError("no mask token: the tokenizer has neither a mask nor a pad token; pass reserved_id")
