"""Eagle3 drafter configuration, derived from the target like the published Eagle3 drafters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from draftflow.models.target_weights import rope_theta


@dataclass
class Eagle3Config:
    hidden_size: int  # = the target's hidden size (embeddings are the target's)
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    num_aux_layers: int  # target layers concatenated into fc's input
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    norm_before_residual: bool = True  # residual = hidden_norm(h) (True) or the raw h (False)
    freeze_lm_head: bool = False  # lm_head starts from the target's draft rows; trained unless frozen

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError("draft_vocab_size exceeds vocab_size")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        *,
        num_aux_layers: int,
        draft_vocab_size: int | None = None,
        norm_before_residual: bool = True,
        freeze_lm_head: bool = False,
    ) -> Eagle3Config:
        hidden = int(target_config["hidden_size"])
        heads = int(target_config["num_attention_heads"])
        vocab = int(target_config["vocab_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(target_config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(target_config.get("num_key_value_heads") or heads),
            head_dim=int(target_config.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab_size or vocab,
            num_aux_layers=num_aux_layers,
            rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(target_config),
            max_position_embeddings=int(target_config.get("max_position_embeddings", 32768)),
            norm_before_residual=norm_before_residual,
            freeze_lm_head=freeze_lm_head,
        )
