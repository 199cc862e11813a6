"""Eagle3 as a :class:`~draftflow.models.algorithm.DrafterAlgorithm`: a chain of
``speculative_tokens`` drafts, one drafter pass each, trained with training-time test."""

from __future__ import annotations

import torch
from torch import nn

from draftflow.models.algorithm import DrafterAlgorithm, DraftState, TrainSettings
from draftflow.models.common import PackedBatch
from draftflow.models.eagle3 import checkpoint
from draftflow.models.eagle3.model import Eagle3Drafter, eagle3_loss
from draftflow.models.eagle3.section import Eagle3Section
from draftflow.models.losses import LossOutput
from draftflow.models.registry import drafter_kind
from draftflow.models.vocab import DraftVocab


@drafter_kind(section=Eagle3Section)
class Eagle3(DrafterAlgorithm):
    aux_layer_ids_key = checkpoint.AUX_LAYER_IDS_KEY
    architecture = checkpoint.ARCHITECTURE

    @classmethod
    def build(
        cls,
        recipe,
        target_model: str,
        *,
        num_context_layers: int,
        vocab: DraftVocab | None,
        target_head: nn.Module | None = None,
    ) -> Eagle3:
        spec = recipe.drafter
        model = Eagle3Drafter.from_target(target_model, num_aux_layers=num_context_layers, vocab=vocab)
        model.checkpoint_steps = spec.activation_checkpointing
        return cls(
            model,
            speculative_tokens=spec.speculative_tokens,
            settings=TrainSettings(spec, recipe.training.loss, target_head),
        )

    @classmethod
    def model_from_config(cls, config: dict, vocab: DraftVocab) -> Eagle3Drafter:
        return Eagle3Drafter(checkpoint.config_from_file(config), vocab)

    def loss(self, batch: PackedBatch, generator: torch.Generator | None = None) -> LossOutput:
        s = self._settings()
        return eagle3_loss(
            self.model,
            batch,
            steps=s.drafter.ttt_steps,
            decay=s.drafter.ttt_decay,
            loss=s.loss,
            target_head=s.target_head,
        )

    @torch.no_grad()
    def propose(self, state: DraftState) -> list[int]:
        processed = torch.tensor([state.tokens[:-1]])
        bonus = torch.tensor([state.tokens[-1]])
        drafts = self.model.propose(state.aux_hidden[None], processed, bonus, self.speculative_tokens)
        return drafts[0].tolist()

    def config_fields(self, aux_layer_ids: list[int]) -> tuple[dict, dict]:
        return checkpoint.config_fields(self.model.config, aux_layer_ids)

    @classmethod
    def config_problems(cls, config: dict, aux_layer_ids: list[int]) -> list[str]:
        declared = (config.get("transformer_layer_config") or {}).get("num_aux_hidden_states")
        if declared in (None, len(aux_layer_ids)):
            return []
        return [
            f"transformer_layer_config.num_aux_hidden_states {declared} != {len(aux_layer_ids)} aux "
            "layer ids (vLLM sizes fc from it)"
        ]
