"""Label alignment, loss weights, acceptance metrics, the target head and the mask token."""

from __future__ import annotations

import math

import pytest
import torch

from draftflow.models.dflash import resolve_mask_token_id, sample_anchors
from draftflow.models.dflash.model import block_targets
from draftflow.models.eagle3.model import step_targets
from draftflow.models.losses import dflash_position_weights, draft_metrics, token_cross_entropy
from draftflow.models.target_weights import TargetHead


def test_dflash_block_targets_are_the_tokens_after_the_anchor(synthetic):
    batch = synthetic.batch
    start, end, _ = batch.documents()
    anchors, valid = sample_anchors(batch.loss_mask, start, end, 4, 8, torch.Generator().manual_seed(0))
    idx, labels, labelled = block_targets(batch.input_ids, batch.loss_mask, end, anchors, valid, 4)
    for b in range(anchors.shape[0]):
        for i in range(anchors.shape[1]):
            a = int(anchors[b, i])
            for j in range(1, 4):
                assert int(idx[b, i, j - 1]) == a + j
                assert int(labels[b, i, j - 1]) == int(batch.input_ids[b, a + j])
                assert bool(labelled[b, i, j - 1]) == (
                    bool(valid[b, i]) and bool(batch.loss_mask[b, a + j]) and a + j < int(end[b, a])
                )


def test_eagle3_step_targets():
    ids = torch.arange(10, 22)[None]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    doc_end = torch.tensor([[6] * 6 + [12] * 6])
    for step in range(3):
        labels, ok = step_targets(ids, mask, doc_end, step)
        for i in range(12):
            j = i + 2 + step
            assert bool(ok[0, i]) == (j < int(doc_end[0, i]) and bool(mask[0, j]))
            if j < 12:
                assert int(labels[0, i]) == int(ids[0, j])


def test_position_weights():
    w = dflash_position_weights(5, gamma=4.0)
    assert w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[2:], torch.tensor([math.exp(-1 / 4), math.exp(-2 / 4), math.exp(-3 / 4)]))


def test_metrics_count_oov_as_wrong_and_stop_runs():
    pred = torch.tensor([[1, 2, 3], [1, 9, 3], [5, 5, 5], [1, 2, 3]])
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [-1, 5, 5], [1, 2, 3]])  # -1: outside the draft vocab
    labelled = torch.tensor([[True, True, True], [True, True, True], [True, True, True], [True, True, False]])
    valid = torch.tensor([True, True, True, False])  # the last draft is padding
    m = draft_metrics(pred, labels, labelled, valid)
    assert m.counts.tolist() == [3, 3, 3] and m.correct.tolist() == [2, 2, 3]
    assert m.prefix_acceptance_length == pytest.approx(1 + (3 + 1 + 0) / 3)
    acc = [2 / 3, 2 / 3, 1.0]
    assert m.acceptance_length == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    assert set(m.as_dict()) == {"acc_1", "acc_2", "acc_3", "acceptance_length", "prefix_acceptance_length"}


def test_token_cross_entropy_ignores_negative_labels():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[0, -1, 4], [-1, -1, 2]])
    ce = token_cross_entropy(logits, labels)
    assert ce[0, 1] == 0 and ce[1, 0] == 0
    torch.testing.assert_close(ce[0, 0], -torch.log_softmax(logits[0, 0], -1)[0])


def test_target_head_reproduces_the_targets_logits_on_the_draft_vocab(synthetic):
    head = TargetHead.from_pretrained(synthetic.target_dir, synthetic.vocab)
    ours = head(synthetic.batch.last_hidden)
    theirs = synthetic.logits[..., synthetic.vocab.target_ids()]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_mask_token_resolution(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tok.mask_token_id is None
    assert resolve_mask_token_id(tok) == tok.pad_token_id  # SmolLM2: pad = <|im_end|>
    assert resolve_mask_token_id(tok, override=17) == 17
    tok.add_special_tokens({"mask_token": "<|mask|>"})
    assert resolve_mask_token_id(tok) == tok.mask_token_id

    class Bare:
        mask_token_id = None
        pad_token_id = None

    assert resolve_mask_token_id(Bare(), reserved_id=49000) == 49000
    with pytest.raises(ValueError, match="reserved_id"):
        resolve_mask_token_id(Bare())


def test_dflash_loss_weights_slots_by_decay_and_ignores_the_anchor_slot(synthetic):
    from draftflow.models.dflash import DFlashDrafter, dflash_loss
    from draftflow.models.dflash.model import block_targets

    torch.manual_seed(0)
    model = DFlashDrafter.from_target(
        synthetic.target_dir,
        num_layers=1,
        block_size=4,
        mask_token_id=0,
        num_context_layers=3,
        vocab=synthetic.vocab,
    )
    batch = synthetic.batch
    start, end, pos = batch.documents()
    anchors = sample_anchors(batch.loss_mask, start, end, 4, 8, torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids, bpos, lo, hi = model.make_blocks(batch.input_ids, pos, start, *anchors)
        logits = model.compute_logits(model(ids, bpos, model.fuse_context(batch.hidden_states), pos, lo, hi))
        _, labels, labelled = block_targets(batch.input_ids, batch.loss_mask, end, *anchors, 4)
        labels = synthetic.vocab.to_draft(labels).masked_fill(~labelled, -1)
        ce = token_cross_entropy(logits[:, :, 1:], labels)  # slots 1..3
        w = dflash_position_weights(4, 2.0)[1:] * (labels >= 0)
        expected = (ce * w).sum() / w.sum()
        got = dflash_loss(model, batch, gamma=2.0, max_anchors=8, anchors=anchors).loss
    torch.testing.assert_close(got, expected)
