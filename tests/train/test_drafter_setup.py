"""The drafter the trainer builds: where its parts live and what they share."""

from __future__ import annotations

import pytest
import torch

from draftflow.plan import Plan
from draftflow.train import drafter

# the soft loss reads the target's final norm + head (the last layer's state must be stored)
TARGET_LOGITS = ["training.loss=target_logits", "extraction.layer_ids=[2, 15, 27, 30]"]
KINDS = {
    "dflash": [],
    "eagle3": ["drafter={kind: eagle3, draft_vocab_size: null, ttt_steps: 2}"],
}


def _setup(recipe, kind: str) -> drafter.DrafterSetup:
    overrides = TARGET_LOGITS + ["drafter.draft_vocab_size=null"] + KINDS[kind]
    return drafter.build(Plan.load(str(recipe), overrides))


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_target_head_goes_to_the_training_device_with_the_drafter(train_recipe, kind):
    # On CUDA the trainer moved only the model: the target head stayed on the CPU and the
    # first step of a target_logits run failed (CUDA states times CPU rows). "meta" stands in
    # for a device this host does not have.
    setup = _setup(train_recipe, kind)
    model = setup.to(torch.device("meta"))
    head = setup.algorithm.settings.target_head
    tensors = [*model.parameters(), *model.buffers(), *head.buffers()]
    assert {t.device.type for t in tensors} == {"meta"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_frozen_drafter_head_is_the_target_heads_rows_not_a_copy(train_recipe, kind):
    setup = _setup(train_recipe, kind)
    rows, weight = setup.algorithm.settings.target_head.head, setup.model.lm_head.weight
    assert torch.equal(rows, weight)  # both start from the target's rows
    shared = rows.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert shared == (not weight.requires_grad), "frozen rows are held once; a trained head has its own"
    if weight.requires_grad:  # training the drafter's head leaves the target's alone
        with torch.no_grad():
            weight.add_(1.0)
        assert not torch.equal(rows, weight)
