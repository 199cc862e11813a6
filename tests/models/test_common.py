"""Shared building blocks: norms and RoPE against transformers, range attention and LSE merge."""

from __future__ import annotations

import warnings

import pytest
import torch

from draftflow.models.common import (
    PackedBatch,
    RMSNorm,
    RotaryEmbedding,
    dense_attention_lse,
    document_bounds,
    merge_attention,
    range_attention_dense,
    range_attention_flex,
    with_every_position_labelled,
    with_feature_noise,
)


def naive_attention(q, k, v, visible, scale):
    """Per query and head: explicit softmax over the visible keys (zeros when none)."""
    bt, nq, nh, hd = q.shape
    g = nh // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(bt):
        for i in range(nq):
            keys = visible[b, i].nonzero().flatten()
            if keys.numel() == 0:
                continue
            for h in range(nh):
                p = torch.softmax(k[b, keys, h // g] @ q[b, i, h] * scale, 0)
                out[b, i, h] = p @ v[b, keys, h // g]
    return out


def test_rmsnorm_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(3, 5, 64)
    ours, theirs = RMSNorm(64, 1e-5), LlamaRMSNorm(64, 1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)


def test_rope_matches_transformers_neox_layout():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    pos = torch.tensor([[0, 1, 5, 17, 300]])
    x = torch.randn(1, 5, 4, 16)  # [B, T, heads, hd]
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    theirs, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    ours = RotaryEmbedding(16, 100000.0)(x, pos)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=1e-5)


def _random_ranges(bt, nq, t, gen):
    hi = torch.randint(0, t + 1, (bt, nq), generator=gen)
    lo = (hi - torch.randint(0, t, (bt, nq), generator=gen)).clamp_min(0)
    return lo, hi


def test_range_attention_dense_equals_naive_and_chunking_does_not_matter():
    gen = torch.Generator().manual_seed(0)
    bt, nq, t, nh, nkv, hd = 2, 37, 29, 4, 2, 8
    q, k, v = torch.randn(bt, nq, nh, hd), torch.randn(bt, t, nkv, hd), torch.randn(bt, t, nkv, hd)
    lo, hi = _random_ranges(bt, nq, t, gen)
    idx = torch.arange(t)
    visible = (idx >= lo[..., None]) & (idx < hi[..., None])
    ref = naive_attention(q, k, v, visible, 0.3)
    for budget in (1 << 24, 64):  # one chunk; many chunks of a few queries
        out, lse = range_attention_dense(q, k, v, lo, hi, 0.3, max_chunk_elems=budget)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert torch.isinf(lse[hi <= lo]).all() and torch.isfinite(lse[hi > lo]).all()


@pytest.mark.slow
def test_range_attention_flex_equals_dense_forward():
    # PyTorch has no CPU backward for flex_attention; the CPU test covers the forward (eager,
    # unfused); on GPU the same call is compiled and block-sparse.
    gen = torch.Generator().manual_seed(1)
    bt, nq, t, nh, nkv, hd = 2, 40, 50, 4, 2, 16
    q, k, v = torch.randn(bt, nq, nh, hd), torch.randn(bt, t, nkv, hd), torch.randn(bt, t, nkv, hd)
    lo, hi = _random_ranges(bt, nq, t, gen)
    out_d, lse_d = range_attention_dense(q, k, v, lo, hi, 0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out_f, lse_f = range_attention_flex(q, k, v, lo, hi, 0.25)
    torch.testing.assert_close(out_f, out_d, rtol=0, atol=1e-5)
    finite = torch.isfinite(lse_d)
    torch.testing.assert_close(lse_f[finite], lse_d[finite], rtol=0, atol=1e-5)


def test_merge_attention_is_exact_softmax_over_the_union():
    bt, nq, nh, nkv, hd = 1, 6, 4, 2, 8
    q = torch.randn(bt, nq, nh, hd)
    k, v = torch.randn(bt, 20, nkv, hd), torch.randn(bt, 20, nkv, hd)
    vis = torch.rand(bt, nq, 20) < 0.6
    vis[..., 0] = True
    a, b = vis.clone(), vis.clone()
    a[..., 10:] = False
    b[..., :10] = False
    out_a, lse_a = dense_attention_lse(q, k, v, a, 0.5)
    out_b, lse_b = dense_attention_lse(q, k, v, b, 0.5)
    ref = naive_attention(q, k, v, vis, 0.5)
    torch.testing.assert_close(merge_attention(out_a, lse_a, out_b, lse_b), ref, rtol=0, atol=1e-5)


def test_empty_rows_give_zero_output_and_finite_gradients():
    q = torch.randn(1, 3, 2, 4, requires_grad=True)
    k = torch.randn(1, 5, 2, 4, requires_grad=True)
    v = torch.randn(1, 5, 2, 4, requires_grad=True)
    lo, hi = torch.tensor([[0, 2, 3]]), torch.tensor([[0, 4, 3]])  # rows 0 and 2 see nothing
    out, lse = range_attention_dense(q, k, v, lo, hi, 0.5)
    other = (torch.randn(1, 3, 2, 4), torch.zeros(1, 3, 2))
    merged = merge_attention(out, lse, *other)
    merged.sum().backward()
    assert out[0, 0].abs().sum() == 0 and torch.isinf(lse[0, [0, 2]]).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_document_bounds_and_default_positions():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 7, 7]])
    start, end = document_bounds(doc)
    assert start.tolist() == [[0, 0, 0, 3, 3, 5], [0, 0, 0, 0, 4, 4]]
    assert end.tolist() == [[3, 3, 3, 5, 5, 6], [4, 4, 4, 4, 6, 6]]
    batch = PackedBatch(torch.zeros_like(doc), torch.zeros(2, 6, 1, 1), torch.ones_like(doc), doc)
    assert batch.documents()[2].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    with pytest.raises(ValueError, match="contiguous"):
        document_bounds(torch.tensor([[0, 1, 0]]))


def test_rope_theta_from_target_configs():
    from draftflow.models.target_weights import rope_theta

    assert rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == 1e6
    llama31 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}
    assert rope_theta(llama31) == 500000.0  # the drafter keeps default RoPE with the target's base
    gemma = {
        "rope_parameters": {"sliding_attention": {"rope_theta": 1e4}, "full_attention": {"rope_theta": 1e6}}
    }
    assert rope_theta(gemma) == 1e6
    assert rope_theta({"rope_theta": 5e5}) == 5e5 and rope_theta({}) == 1e4


def test_feature_noise_is_relative_to_each_tokens_scale_per_layer_and_leaves_the_target_exact():
    g = torch.Generator().manual_seed(0)
    # two layers four orders of magnitude apart, tokens of different scale within each
    scale = torch.tensor([1.0, 1e4])[None, None, :, None] * torch.linspace(0.5, 8, 256)[None, :, None, None]
    hidden = torch.randn(1, 256, 2, 512, generator=g) * scale
    batch = PackedBatch(
        input_ids=torch.arange(256)[None],
        hidden_states=hidden,
        loss_mask=torch.ones(1, 256),
        last_hidden=torch.randn(1, 256, 512, generator=g),
    )
    noisy = with_feature_noise(batch, 0.1, torch.Generator().manual_seed(1))
    rms = hidden.pow(2).mean(-1, keepdim=True).sqrt()
    relative = (noisy.hidden_states - hidden) / rms  # unit-free: the same spread at every scale
    for layer in range(2):
        for tokens in (slice(0, 32), slice(224, 256)):
            std = relative[0, tokens, layer].std().item()
            assert abs(std - 0.1) < 0.01, (layer, tokens, std)
    assert noisy.last_hidden is batch.last_hidden and noisy.input_ids is batch.input_ids
    assert torch.equal(batch.hidden_states, hidden)  # the loader's tensor is not modified in place
    again = with_feature_noise(batch, 0.1, torch.Generator().manual_seed(1))
    assert torch.equal(again.hidden_states, noisy.hidden_states)  # seeded: a resumed step draws the same
    assert torch.equal(with_feature_noise(batch, 0.0, torch.Generator()).hidden_states, hidden)


def test_every_position_labelled_counts_prompt_tokens_and_keeps_the_rest():
    batch = PackedBatch(
        input_ids=torch.arange(6)[None],
        hidden_states=torch.randn(1, 6, 2, 4),
        loss_mask=torch.tensor([[0, 0, 1, 1, 0, 1]], dtype=torch.uint8),
        doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]),
    )
    every = with_every_position_labelled(batch)
    assert every.loss_mask.tolist() == [[1] * 6] and every.loss_mask.dtype == torch.uint8
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1]]  # the loader's batch is untouched
    assert every.hidden_states is batch.hidden_states and every.doc_ids is batch.doc_ids
