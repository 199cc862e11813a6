"""The toy kind as a :class:`~draftflow.models.algorithm.DrafterAlgorithm`."""

from __future__ import annotations

import torch

from draftflow.models import speculators
from draftflow.models.algorithm import DrafterAlgorithm, DraftState, TrainSettings
from draftflow.models.common import PackedBatch, shift_left
from draftflow.models.losses import LossOutput, draft_metrics, token_cross_entropy, weighted_mean
from draftflow.models.registry import drafter_kind
from draftflow.models.target_weights import load_embeddings, read_config
from draftflow.models.vocab import DraftVocab
from toyhead.model import ToyHeads
from toyhead.section import ToyHeadSection


@drafter_kind(section=ToyHeadSection)
class ToyHead(DrafterAlgorithm):
    aux_layer_ids_key = "toy_aux_hidden_state_layer_ids"
    architecture = "ToySpeculator"

    @classmethod
    def build(cls, recipe, target_model, *, num_context_layers, vocab, target_head=None):
        cfg = read_config(target_model)
        vocab = vocab or DraftVocab.identity(int(cfg["vocab_size"]))
        model = ToyHeads(
            int(cfg["hidden_size"]), num_context_layers, recipe.drafter.speculative_tokens, vocab
        )
        with torch.no_grad():
            model.embed_tokens.weight.copy_(load_embeddings(target_model))
        return cls(
            model, speculative_tokens=model.k, settings=TrainSettings(recipe.drafter, recipe.training.loss)
        )

    @classmethod
    def model_from_config(cls, config, vocab):
        layer = config["transformer_layer_config"]
        return ToyHeads(
            int(layer["hidden_size"]),
            len(config[cls.aux_layer_ids_key]),
            speculators.speculative_tokens(config),
            vocab,
        )

    def loss(self, batch: PackedBatch, generator=None) -> LossOutput:
        m, ids = self.model, batch.input_ids
        logits = m(batch.hidden_states, shift_left(ids, 1))  # [Bt, T, k, Vd]
        _, doc_end, _ = batch.documents()
        idx = torch.arange(ids.shape[1])
        labels = torch.stack([shift_left(ids, 2 + j) for j in range(m.k)], -1)
        labelled = torch.stack(
            [shift_left(batch.loss_mask.bool(), 2 + j, False) & (idx + 2 + j < doc_end) for j in range(m.k)],
            -1,
        )
        draft_labels = m.vocab.to_draft(labels).masked_fill(~labelled, -1)
        loss = weighted_mean(token_cross_entropy(logits, draft_labels), labelled.float())
        metrics = draft_metrics(
            logits.argmax(-1).reshape(-1, m.k),
            draft_labels.reshape(-1, m.k),
            labelled.reshape(-1, m.k),
            labelled[..., 0].reshape(-1),
        )
        return LossOutput(loss, metrics)

    @torch.no_grad()
    def propose(self, state: DraftState) -> list[int]:
        logits = self.model(state.aux_hidden[-1:], torch.tensor([state.tokens[-1]]))[0]  # [k, Vd]
        return self.vocab.to_target(logits.argmax(-1)).tolist()

    def config_fields(self, aux_layer_ids):
        m = self.model
        ids = speculators.check_aux_layer_ids(aux_layer_ids, m.fc.in_features // m.fc.out_features)
        layer = {
            "model_type": self.kind,
            "hidden_size": m.fc.out_features,
            "vocab_size": m.vocab.target_vocab_size,
        }
        return {"draft_vocab_size": m.draft_vocab, self.aux_layer_ids_key: ids}, layer
