"""DFlash as a :class:`~draftflow.models.algorithm.DrafterAlgorithm`: one block of
``speculative_tokens`` drafts (at most ``block_size - 1``) per forward pass from the fused
target context."""

from __future__ import annotations

import torch
from torch import nn

from draftflow.models import speculators
from draftflow.models.algorithm import DrafterAlgorithm, DraftState, TrainSettings
from draftflow.models.common import PackedBatch
from draftflow.models.dflash import checkpoint
from draftflow.models.dflash.config import resolve_mask_token_id
from draftflow.models.dflash.model import DFlashDrafter, dflash_loss
from draftflow.models.dflash.section import DFlashSection
from draftflow.models.known_issues import DFLASH_CPU_K_NORM
from draftflow.models.losses import LossOutput
from draftflow.models.registry import drafter_kind
from draftflow.models.vocab import DraftVocab


def recipe_mask_token(recipe, target_model: str) -> int:
    """The recipe's ``drafter.mask_token_id``, else the tokenizer's mask or pad token."""
    override = recipe.drafter.mask_token_id
    if override is not None:
        return override
    from transformers import AutoTokenizer  # heavy: only when the recipe does not say

    tokenizer = AutoTokenizer.from_pretrained(target_model, revision=recipe.target.revision)
    return resolve_mask_token_id(tokenizer)


@drafter_kind(section=DFlashSection)
class DFlash(DrafterAlgorithm):
    aux_layer_ids_key = checkpoint.AUX_LAYER_IDS_KEY
    architecture = checkpoint.ARCHITECTURE

    def __init__(
        self,
        model: DFlashDrafter,
        *,
        speculative_tokens: int | None = None,
        settings: TrainSettings | None = None,
    ):
        k = model.served_block(speculative_tokens) - 1  # checks 1 <= k <= block_size - 1
        super().__init__(model, speculative_tokens=k, settings=settings)

    @classmethod
    def build(
        cls,
        recipe,
        target_model: str,
        *,
        num_context_layers: int,
        vocab: DraftVocab | None,
        target_head: nn.Module | None = None,
    ) -> DFlash:
        spec = recipe.drafter
        model = DFlashDrafter.from_target(
            target_model,
            num_layers=spec.num_layers,
            block_size=spec.block_size,
            mask_token_id=recipe_mask_token(recipe, target_model),
            num_context_layers=num_context_layers,
            vocab=vocab,
            init_from_target=spec.init_from_target,
        )
        model.checkpoint_layers = spec.activation_checkpointing
        return cls(
            model,
            speculative_tokens=spec.speculative_tokens,
            settings=TrainSettings(spec, recipe.training.loss, target_head),
        )

    @classmethod
    def model_from_config(cls, config: dict, vocab: DraftVocab) -> DFlashDrafter:
        return DFlashDrafter(checkpoint.config_from_file(config), vocab)

    def loss(self, batch: PackedBatch, generator: torch.Generator | None = None) -> LossOutput:
        s = self._settings()
        return dflash_loss(
            self.model,
            batch,
            max_anchors=s.drafter.max_anchors,
            gamma=s.drafter.decay_gamma,
            loss=s.loss,
            target_head=s.target_head,
            generator=generator,
        )

    @torch.no_grad()
    def propose(self, state: DraftState) -> list[int]:
        bonus = torch.tensor([state.tokens[-1]])
        return self.model.propose(state.aux_hidden[None], bonus, num_tokens=self.speculative_tokens)[
            0
        ].tolist()

    @property
    def mask_token_id(self) -> int:
        return self.model.config.mask_token_id

    def config_fields(self, aux_layer_ids: list[int]) -> tuple[dict, dict]:
        return checkpoint.config_fields(self.model.config, aux_layer_ids)

    @classmethod
    def config_problems(cls, config: dict, aux_layer_ids: list[int]) -> list[str]:
        out = []
        vocab = int((config.get("transformer_layer_config") or {}).get("vocab_size", 0))
        mask = config.get("mask_token_id")
        if mask is None or not 0 <= int(mask) < vocab:
            out.append(f"config.json mask_token_id {mask} is not a token of the {vocab}-token vocabulary")
        block = config.get("block_size")
        spec = speculators.speculative_tokens(config)
        if block is not None and spec is not None and not 1 <= spec <= int(block) - 1:
            out.append(
                f"config.json block_size {block} drafts 1 to {int(block) - 1} tokens but "
                f"speculative_tokens is {spec}"
            )
        return out

    @classmethod
    def provenance_problems(cls, config: dict, provenance: dict) -> list[str]:
        if config.get("mask_token_id") == provenance.get("mask_token_id"):
            return []
        return [
            f"config.json mask_token_id {config.get('mask_token_id')} != trained "
            f"{provenance.get('mask_token_id')} (the block's mask slots would be fed another token "
            "than in training)"
        ]

    @classmethod
    def known_serving_issue(
        cls, config: dict, device: str, fixes: frozenset[str] = frozenset()
    ) -> str | None:
        layers = int((config.get("transformer_layer_config") or {}).get("num_hidden_layers", 1))
        if device == "cpu" and layers > 1 and DFLASH_CPU_K_NORM not in fixes:
            return (
                f"known defect: vLLM 0.32's CPU build drafts wrongly with a {layers}-layer DFlash "
                "(its rms_norm kernel applies layer 0's k_norm weights to every layer); output stays "
                "lossless, acceptance drops. Fixed by draftflow's vLLM plugin, which this vLLM "
                "virtualenv does not load: scripts/bootstrap.sh installs plugins/draftflow_vllm_cpu"
            )
        return None
