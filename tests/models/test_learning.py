"""Each drafter overfits a fixed batch of real (tiny Llama) hidden states."""

from __future__ import annotations

import pytest
import torch

from draftflow.models.dflash import DFlashDrafter, dflash_loss
from draftflow.models.eagle3 import Eagle3Drafter, eagle3_loss
from draftflow.models.target_weights import TargetHead

MAX_STEPS = 200


def train(model, step_fn, max_steps=MAX_STEPS, lr=3e-3, until=0.95):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    history = []
    for _ in range(max_steps):
        out = step_fn()
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        history.append((out.loss.item(), float(out.metrics.accuracy[0])))
        if until is not None and history[-1][1] >= until:
            break
    return history


def test_dflash_overfits_to_95_percent_position_1(synthetic):
    torch.manual_seed(0)
    model = DFlashDrafter.from_target(
        synthetic.target_dir,
        num_layers=1,
        block_size=4,
        mask_token_id=0,
        num_context_layers=3,
        vocab=synthetic.vocab,
    )
    gen = torch.Generator().manual_seed(0)
    history = train(
        model, lambda: dflash_loss(model, synthetic.batch, gamma=4.0, max_anchors=32, generator=gen)
    )
    assert history[-1][1] >= 0.95, history[-5:]
    assert history[-1][0] < history[0][0]


def test_eagle3_overfits_to_95_percent_position_1(synthetic):
    torch.manual_seed(0)
    model = Eagle3Drafter.from_target(synthetic.target_dir, num_aux_layers=3, vocab=synthetic.vocab)
    history = train(model, lambda: eagle3_loss(model, synthetic.batch, steps=3, decay=0.8))
    assert history[-1][1] >= 0.95, history[-5:]


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_target_logits_loss_decreases(synthetic, kind):
    torch.manual_seed(0)
    head = TargetHead.from_pretrained(synthetic.target_dir, synthetic.vocab)
    if kind == "dflash":
        model = DFlashDrafter.from_target(
            synthetic.target_dir,
            num_layers=1,
            block_size=4,
            mask_token_id=0,
            num_context_layers=3,
            vocab=synthetic.vocab,
        )

        def step():
            return dflash_loss(
                model,
                synthetic.batch,
                gamma=4.0,
                max_anchors=16,
                loss="target_logits",
                target_head=head,
                generator=torch.Generator().manual_seed(0),
            )
    else:
        model = Eagle3Drafter.from_target(synthetic.target_dir, num_aux_layers=3, vocab=synthetic.vocab)

        def step():
            return eagle3_loss(
                model, synthetic.batch, steps=2, decay=0.8, loss="target_logits", target_head=head
            )

    history = train(model, step, max_steps=30, until=None)
    assert history[-1][0] < history[0][0] - 0.01, history[::10]
