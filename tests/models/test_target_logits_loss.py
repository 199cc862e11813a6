"""The ``target_logits`` loss against naive per-item formulas (the fast paths must stay exact).

The losses apply the target head once per distinct token position and gather, share one
soft cross-entropy that never materialises the gathered target distribution, and feed the
draft head a contiguous matrix; each check here recomputes the same quantity the slow,
obvious way: the head applied to each item's own target state, ``-sum p log_softmax``.
"""

from __future__ import annotations

import torch

from draftflow.models.common import shift_left
from draftflow.models.dflash import DFlashDrafter, dflash_loss, sample_anchors
from draftflow.models.dflash.model import block_targets
from draftflow.models.eagle3 import Eagle3Drafter
from draftflow.models.eagle3.model import eagle3_loss, step_targets
from draftflow.models.losses import (
    dflash_position_weights,
    head_soft_cross_entropy,
    soft_cross_entropy,
    soft_cross_entropy_gathered,
    weighted_mean,
)
from draftflow.models.target_weights import TargetHead


def naive_soft_ce(logits_row: torch.Tensor, target_row: torch.Tensor) -> torch.Tensor:
    return -(torch.softmax(target_row, -1) * torch.log_softmax(logits_row, -1)).sum()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_dflash_target_logits_loss_equals_per_item_formula(synthetic):
    torch.manual_seed(0)
    b, gamma = 4, 2.0
    model = DFlashDrafter.from_target(
        synthetic.target_dir,
        num_layers=1,
        block_size=b,
        mask_token_id=0,
        num_context_layers=3,
        vocab=synthetic.vocab,
    )
    head = TargetHead.from_pretrained(synthetic.target_dir, synthetic.vocab)
    batch = synthetic.batch
    start, end, pos = batch.documents()
    # 24 anchors of ~2·48 eligible positions: blocks overlap, so target positions repeat
    anchors = sample_anchors(batch.loss_mask, start, end, b, 24, torch.Generator().manual_seed(0))
    got = dflash_loss(
        model,
        batch,
        gamma=gamma,
        max_anchors=24,
        loss="target_logits",
        target_head=head,
        anchors=anchors,
    ).loss
    got.backward()
    fast = grads(model)
    model.zero_grad()

    ids, bpos, lo, hi = model.make_blocks(batch.input_ids, pos, start, *anchors)
    hidden = model(ids, bpos, model.fuse_context(batch.hidden_states), pos, lo, hi)
    tgt, _, labelled = block_targets(batch.input_ids, batch.loss_mask, end, *anchors, b)
    w = dflash_position_weights(b, gamma)[1:]
    num, den = torch.zeros(()), torch.zeros(())
    for r in range(tgt.shape[0]):
        for i in range(tgt.shape[1]):
            for j in range(b - 1):
                if labelled[r, i, j]:
                    logits = model.lm_head(hidden[r, i, j + 1])
                    target = head(batch.last_hidden[r, int(tgt[r, i, j]) - 1])
                    num = num + w[j] * naive_soft_ce(logits, target)
                    den = den + w[j]
    expected = num / den
    expected.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, g in grads(model).items():
        torch.testing.assert_close(fast[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_eagle3_target_logits_loss_equals_per_step_formula(synthetic):
    torch.manual_seed(0)
    steps, decay = 3, 0.8
    model = Eagle3Drafter.from_target(synthetic.target_dir, num_aux_layers=3, vocab=synthetic.vocab)
    head = TargetHead.from_pretrained(synthetic.target_dir, synthetic.vocab)
    batch = synthetic.batch
    got = eagle3_loss(model, batch, steps=steps, decay=decay, loss="target_logits", target_head=head).loss
    got.backward()
    fast = grads(model)
    model.zero_grad()

    start, end, pos = batch.documents()
    outs = model.forward_ttt(batch.input_ids, batch.hidden_states, pos, start, steps)
    expected = torch.zeros(())
    for k, out in enumerate(outs):
        _, ok = step_targets(batch.input_ids, batch.loss_mask.bool(), end, k)
        per_item = soft_cross_entropy(model.compute_logits(out), head(shift_left(batch.last_hidden, 1 + k)))
        expected = expected + decay**k * (per_item * ok).sum() / ok.sum()
    expected.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, g in grads(model).items():
        torch.testing.assert_close(fast[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_target_head_probs_at_equals_the_head_applied_per_position(synthetic):
    head = TargetHead.from_pretrained(synthetic.target_dir, synthetic.vocab)
    last = synthetic.batch.last_hidden  # [2, 64, H]
    index = torch.tensor([[5, 9, 5, 63, 0, 9], [9, 9, 1, 2, 63, 5]])  # repeats within and across rows
    probs, rows = head.probs_at(last, index)
    assert probs.shape[0] == 9  # distinct (row, position) pairs
    for b in range(2):
        for n in range(index.shape[1]):
            expected = torch.softmax(head(last[b, int(index[b, n])]), -1)
            torch.testing.assert_close(probs[rows[b, n]], expected, rtol=1e-6, atol=1e-7)
    keep = torch.tensor(
        [
            [True, False, False, True, False, False],
            [False, False, True, False, False, True],
        ]
    )
    probs, rows = head.probs_at(last, index, keep)
    assert probs.shape[0] == 4  # only the kept items' positions are computed
    for b, n in keep.nonzero().tolist():
        torch.testing.assert_close(
            probs[rows[b, n]],
            torch.softmax(head(last[b, int(index[b, n])]), -1),
            rtol=1e-6,
            atol=1e-7,
        )


def test_gathered_soft_cross_entropy_equals_the_plain_one_with_gradient():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 3, 50, generator=g)).requires_grad_()
    target_logits = 3 * torch.randn(7, 50, generator=g)
    index = torch.randint(0, 7, (2, 5, 3), generator=g)
    weights = torch.rand(2, 5, 3, generator=g)
    fast = soft_cross_entropy_gathered(logits, torch.softmax(target_logits, -1), index, chunk_rows=4)
    (fast * weights).sum().backward()
    fast_grad, logits.grad = logits.grad.clone(), None
    plain = soft_cross_entropy(logits, target_logits[index])
    (plain * weights).sum().backward()
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_grad, logits.grad, rtol=1e-5, atol=1e-6)


def test_head_fused_soft_cross_entropy_equals_the_plain_one_with_gradient():
    """The head fused into the loss (chunked, gradients formed in forward) against head →
    soft CE → weighted mean: value, argmax, and the gradient of the rows and of a trained head,
    across chunks; all-zero weights give a zero loss and zero gradients."""
    g = torch.Generator().manual_seed(0)
    target_logits = 3 * torch.randn(7, 50, generator=g)
    index = torch.randint(0, 7, (11,), generator=g)
    for weights in (torch.rand(11, generator=g), torch.zeros(11)):
        results = []
        for fused in (True, False):
            head = torch.nn.Linear(16, 50, bias=False)
            with torch.no_grad():
                head.weight.copy_(torch.randn(50, 16, generator=torch.Generator().manual_seed(1)))
            hidden = torch.randn(11, 16, generator=torch.Generator().manual_seed(2)).requires_grad_()
            if fused:
                loss, pred = head_soft_cross_entropy(
                    hidden, head, torch.softmax(target_logits, -1), index, weights, chunk_rows=4
                )
            else:
                logits = head(hidden)
                loss = weighted_mean(soft_cross_entropy(logits, target_logits[index]), weights)
                pred = logits.argmax(-1)
            (3.0 * loss).backward()
            results.append((loss.detach(), pred, hidden.grad, head.weight.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(results[0][0]) == 0.0 and not results[0][2].any()
