"""A third drafter kind is one algorithm class plus one registration: a toy kind defined here runs
through the real trainer, the export with provenance, the contract check and the offline evaluator
without any of them knowing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import nn

from draftflow import models
from draftflow.evaluation.contract import check_contract
from draftflow.evaluation.run import evaluate_checkpoint
from draftflow.models import speculators
from draftflow.models.algorithm import DrafterAlgorithm, DraftState, TrainSettings
from draftflow.models.common import PackedBatch, shift_left
from draftflow.models.losses import LossOutput, draft_metrics, token_cross_entropy, weighted_mean
from draftflow.models.target_weights import load_embeddings, read_config
from draftflow.models.vocab import DraftVocab
from draftflow.paths import EXPORT_CONFIG
from draftflow.plan import Plan
from draftflow.recipe.schema import Section
from draftflow.train import RESULT_PREFIX
from draftflow.train.__main__ import main as train_main

pytestmark = pytest.mark.slow


class ToySection(Section):
    kind: Literal["toy"]
    speculative_tokens: int = 2
    draft_vocab_size: int | None = 512
    context_layer_ids: list[int] | None = None


class ToyModel(nn.Module):
    """k independent heads on fc(aux states) + the bonus token's embedding (Medusa-like)."""

    def __init__(self, hidden: int, num_aux: int, k: int, vocab: DraftVocab):
        super().__init__()
        self.k, self.draft_vocab = k, vocab.draft_vocab_size
        self.embed_tokens = nn.Embedding(vocab.target_vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.heads = nn.Linear(hidden, k * vocab.draft_vocab_size, bias=False)
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t, self.t2d)

    def forward(self, aux: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        h = self.fc(aux.flatten(-2).to(self.fc.weight.dtype)) + self.embed_tokens(bonus)
        return self.heads(h).unflatten(-1, (self.k, self.draft_vocab))


class Toy(DrafterAlgorithm):
    kind = "toy"
    aux_layer_ids_key = "toy_aux_hidden_state_layer_ids"
    architecture = "ToySpeculator"

    @classmethod
    def build(cls, recipe, target_model, *, num_context_layers, vocab, target_head=None):
        cfg = read_config(target_model)
        vocab = vocab or DraftVocab.identity(int(cfg["vocab_size"]))
        model = ToyModel(
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
        return ToyModel(
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
            "model_type": "toy",
            "hidden_size": m.fc.out_features,
            "vocab_size": m.vocab.target_vocab_size,
        }
        return {"draft_vocab_size": m.draft_vocab, self.aux_layer_ids_key: ids}, layer


@pytest.fixture
def toy_kind():
    models.register(Toy, section=ToySection)
    yield
    models.unregister("toy")


def test_a_registered_toy_kind_trains_exports_and_evaluates_offline(toy_kind, train_dir, capsys):
    recipe = str(train_dir / "recipe.yaml")
    overrides = [
        "drafter={kind: toy}",
        "evaluation.num_prompts=2",
        "evaluation.max_new_tokens=12",
        "evaluation.in_vllm=false",
    ]
    args = [recipe, "--run-id", "toy", "--max-steps", "4"] + sum((["--set", o] for o in overrides), [])
    assert train_main(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(RESULT_PREFIX))
    export = Path(json.loads(line[len(RESULT_PREFIX) :])["export_dir"])

    config = json.loads((export / EXPORT_CONFIG).read_text())
    assert config["speculators_model_type"] == "toy" and config["toy_aux_hidden_state_layer_ids"] == [
        2,
        15,
        27,
    ]
    assert speculators.speculative_tokens(config) == 2
    plan = Plan.load(recipe, overrides)
    assert check_contract(export, plan.target, verifier=plan.target_model, fingerprint=plan.fingerprint) == []

    evaluation = evaluate_checkpoint(export, plan, out_dir=train_dir / "eval")
    offline = evaluation.offline
    assert offline.drafter == "toy" and offline.draft_length == 2 and offline.num_prompts == 2
    assert offline.drafts > 0 and offline.outputs_identical == 2  # lossless whatever the toy proposes
    assert evaluation.contract_problems == []


def test_an_unregistered_kind_is_a_one_line_recipe_error(train_dir):
    from draftflow.recipe.load import RecipeError

    with pytest.raises(RecipeError, match=r"drafter: .*'toy'.*'dflash', 'eagle3'"):
        Plan.load(str(train_dir / "recipe.yaml"), ["drafter={kind: toy}"])
