"""DFlash activation checkpointing per decoder layer: the same loss and gradients, fewer saved activations."""

from __future__ import annotations

import copy

import torch

from draftflow.models.common import PackedBatch
from draftflow.models.dflash import DFlashConfig, DFlashDrafter, dflash_loss, sample_anchors


def _setup():
    torch.manual_seed(0)
    cfg = DFlashConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=97,
        draft_vocab_size=97,
        num_context_layers=2,
        block_size=4,
        mask_token_id=3,
    )
    g = torch.Generator().manual_seed(1)
    doc = torch.tensor([[0] * 20 + [1] * 28])
    batch = PackedBatch(
        torch.randint(5, 97, doc.shape, generator=g),
        torch.randn(1, 48, 2, 32, generator=g),
        torch.ones_like(doc),
        doc,
    )
    start, end, _ = batch.documents()
    anchors = sample_anchors(batch.loss_mask, start, end, 4, 12, torch.Generator().manual_seed(2))
    return DFlashDrafter(cfg), batch, anchors


def _loss_grads_and_saved_bytes(model, batch, anchors):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = dflash_loss(model, batch, max_anchors=12, gamma=4.0, anchors=anchors).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, sum(saved)


def test_checkpointed_layers_give_the_same_loss_and_gradients_and_save_fewer_activations():
    plain, batch, anchors = _setup()
    recomputed = copy.deepcopy(plain)
    recomputed.checkpoint_layers = True
    loss_a, grads_a, bytes_a = _loss_grads_and_saved_bytes(plain, batch, anchors)
    loss_b, grads_b, bytes_b = _loss_grads_and_saved_bytes(recomputed, batch, anchors)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys() and any(n.startswith("layers.") for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=0, atol=0, msg=name)
    assert bytes_b < 0.5 * bytes_a, (bytes_b, bytes_a)
