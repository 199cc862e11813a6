"""DFlash mask semantics against a naive per-query loop, the flex path, and memory growth."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from draftflow.models.common import PackedBatch
from draftflow.models.dflash import DFlashConfig, DFlashDrafter, sample_anchors
from draftflow.models.dflash.attention import dflash_attention, dflash_attention_merged

B = 4


def tiny_config(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=97,
        draft_vocab_size=97,
        num_context_layers=2,
        block_size=B,
        mask_token_id=3,
        rope_theta=10000.0,
    )
    return DFlashConfig(**{**base, **kw})


def packed_example(seed: int = 0):
    """Two rows, documents of uneven length, positions restarting per document."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 9 + [1] * 14 + [2] * 7, [4] * 17 + [6] * 13])
    t = doc.shape[1]
    ids = torch.randint(5, 97, doc.shape, generator=g)
    mask = (torch.rand(doc.shape, generator=g) < 0.8).long()
    return PackedBatch(ids, torch.randn(2, t, 2, 32, generator=g), mask, doc)


def naive_visible_context(doc, pos, b, anchor):
    """The rule, stated without ranges: same document and position strictly before the anchor."""
    return [t for t in range(doc.shape[1]) if doc[b, t] == doc[b, anchor] and pos[b, t] < pos[b, anchor]]


def naive_dflash(q, k, v, ctx_k, ctx_v, doc, pos, anchors, valid, scale):
    bt, a, bs, nh, hd = q.shape
    g = nh // k.shape[-2]
    out = torch.zeros_like(q)
    for b in range(bt):
        for i in range(a):
            ctx = naive_visible_context(doc, pos, b, int(anchors[b, i])) if valid[b, i] else []
            for j in range(bs):
                for h in range(nh):
                    keys = torch.cat([ctx_k[b, ctx, h // g], k[b, i, :, h // g]])  # context + whole block
                    values = torch.cat([ctx_v[b, ctx, h // g], v[b, i, :, h // g]])
                    out[b, i, j, h] = torch.softmax(keys @ q[b, i, j, h] * scale, 0) @ values
    return out


def blocks_for(batch, model, max_anchors=16, seed=0):
    start, end, pos = batch.documents()
    anchors, valid = sample_anchors(
        batch.loss_mask, start, end, B, max_anchors, torch.Generator().manual_seed(seed)
    )
    return (start, end, pos, anchors, valid, *model.make_blocks(batch.input_ids, pos, start, anchors, valid))


def test_sampled_anchors_respect_documents_loss_mask_and_block_room():
    batch = packed_example()
    start, end, _ = batch.documents()
    anchors, valid = sample_anchors(batch.loss_mask, start, end, B, 1000, torch.Generator().manual_seed(0))
    ok = batch.loss_mask.bool() & (torch.arange(30) > start) & (torch.arange(30) + B <= end)
    for b in range(2):
        chosen = anchors[b][valid[b]].tolist()
        assert chosen == sorted(chosen) == ok[b].nonzero().flatten().tolist()  # all of them, sorted
    few, few_valid = sample_anchors(batch.loss_mask, start, end, B, 3, torch.Generator().manual_seed(1))
    assert few.shape == (2, 3) and few_valid.all() and ok.gather(1, few).all()


def test_dflash_attention_equals_naive_per_query_reference():
    torch.manual_seed(0)
    batch = packed_example()
    model = DFlashDrafter(tiny_config())
    start, end, pos, anchors, valid, _, _, lo, hi = blocks_for(batch, model)
    a, t, nh, nkv, hd = anchors.shape[1], 30, 4, 2, 8
    q, k, v = torch.randn(2, a, B, nh, hd), torch.randn(2, a, B, nkv, hd), torch.randn(2, a, B, nkv, hd)
    ck, cv = torch.randn(2, t, nkv, hd), torch.randn(2, t, nkv, hd)
    ref = naive_dflash(q, k, v, ck, cv, batch.doc_ids, pos, anchors, valid, 0.35)
    dense = dflash_attention(q, k, v, ck, cv, lo, hi, 0.35, "dense")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = dflash_attention(q, k, v, ck, cv, lo, hi, 0.35, "flex")
    torch.testing.assert_close(dense, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(flex, ref, rtol=0, atol=1e-5)
    # queries of slots 1..B-1 only (the last layer's drafting slots), every slot still a key
    q1 = q[:, :, 1:].contiguous()
    torch.testing.assert_close(
        dflash_attention(q1, k, v, ck, cv, lo, hi, 0.35, "dense"), ref[:, :, 1:], rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        dflash_attention_merged(q1, k, v, ck, cv, lo, hi, 0.35), ref[:, :, 1:], rtol=0, atol=1e-5
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex1 = dflash_attention(q1, k, v, ck, cv, lo, hi, 0.35, "flex")
    torch.testing.assert_close(flex1, ref[:, :, 1:], rtol=0, atol=1e-5)


def test_drafting_slots_only_equals_the_full_forward_with_gradient():
    """The last layer skipping the anchor slot's query, MLP and norm changes no value or
    gradient the loss sees (2 layers: the first still computes every slot)."""
    torch.manual_seed(1)
    batch = packed_example()
    model = DFlashDrafter(tiny_config())
    start, end, pos, anchors, valid, ids, bpos, lo, hi = blocks_for(batch, model)
    weights = torch.randn(2, anchors.shape[1], B - 1, 32)
    grads = []
    for only in (False, True):
        out = model(ids, bpos, model.fuse_context(batch.hidden_states), pos, lo, hi, drafting_slots_only=only)
        out = out if only else out[:, :, 1:]
        grads.append(
            (
                out,
                torch.autograd.grad(
                    (out * weights).sum(),
                    [p for p in model.parameters() if p.requires_grad],
                    allow_unused=True,
                ),
            )
        )
    (full, g_full), (only, g_only) = grads
    torch.testing.assert_close(only, full, rtol=0, atol=1e-6)
    for a, b in zip(g_only, g_full):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_model_visibility_through_the_whole_drafter():
    """Gradients of each slot's output w.r.t. the target states are non-zero exactly on the
    anchor's document before the anchor (2 layers, so also no leak through layer 2); a
    change of any block token changes every slot of that block and no other block."""
    torch.manual_seed(0)
    batch = packed_example()
    model = DFlashDrafter(tiny_config()).eval()
    start, end, pos, anchors, valid, ids, bpos, lo, hi = blocks_for(batch, model, max_anchors=6)
    hidden = batch.hidden_states.clone().requires_grad_(True)
    out = model(ids, bpos, model.fuse_context(hidden), pos, lo, hi)
    probe = torch.randn_like(out)
    for b, i in torch.nonzero(valid).tolist():
        visible = naive_visible_context(batch.doc_ids, pos, b, int(anchors[b, i]))
        for j in range(B):
            (grad,) = torch.autograd.grad((out[b, i, j] * probe[b, i, j]).sum(), hidden, retain_graph=True)
            seen = grad.abs().flatten(2).amax(-1) > 0  # [Bt, T]
            assert seen[b].nonzero().flatten().tolist() == visible, (b, i, j)
            assert not seen[1 - b].any()
    with torch.no_grad():
        base = model(ids, bpos, model.fuse_context(batch.hidden_states), pos, lo, hi)
        for b, i in torch.nonzero(valid).tolist()[:6]:
            for j in range(B):
                changed_ids = ids.clone()
                changed_ids[b, i, j] = (changed_ids[b, i, j] + 1) % 97
                diff = model(changed_ids, bpos, model.fuse_context(batch.hidden_states), pos, lo, hi) - base
                diff = diff.abs().amax(-1) > 1e-6  # [Bt, A, B]
                assert diff[b, i].all(), (b, i, j)  # non-causal: every slot sees slot j
                diff[b, i] = False
                assert not diff.any()  # blocks never see each other


class LargestTensors(TorchDispatchMode):
    """Records the shape of every tensor any op (forward or backward) produces."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(x.shape) for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        return out


def _training_step_shapes(num_anchors: int, t: int = 48) -> list[tuple[int, ...]]:
    from draftflow.models.dflash.model import dflash_loss

    torch.manual_seed(0)
    model = DFlashDrafter(tiny_config(block_size=8, draft_vocab_size=97))
    ids = torch.randint(5, 97, (1, t))
    batch = PackedBatch(ids, torch.randn(1, t, 2, 32), torch.ones(1, t, dtype=torch.long))
    # Many anchors over a short context: repeat every possible anchor so A·B >> T.
    start, end, _ = batch.documents()
    anchors, valid = sample_anchors(batch.loss_mask, start, end, 8, t, None)
    reps = -(-num_anchors // anchors.shape[1])
    anchors, valid = anchors.repeat(1, reps)[:, :num_anchors], valid.repeat(1, reps)[:, :num_anchors]
    with LargestTensors() as rec:
        dflash_loss(
            model, batch, gamma=4.0, max_anchors=num_anchors, anchors=(anchors, valid)
        ).loss.backward()
    return rec.shapes


def test_no_quadratic_tensor_in_anchors():
    """Forward + backward at A·B = 2048 and 8192 query slots over a 48-token context: no
    tensor has two dims >= A·B (so no [A·B, A·B] nor [A·B, T + A·B]), and the largest tensor
    grows linearly with the number of anchors."""
    sizes = {}
    for anchors in (256, 1024):
        shapes = _training_step_shapes(anchors)
        qb = anchors * 8
        assert not [s for s in shapes if sum(d >= qb for d in s) >= 2], f"quadratic tensor at A={anchors}"
        sizes[anchors] = max(torch.Size(s).numel() for s in shapes)
    assert sizes[1024] <= 4.5 * sizes[256], sizes


def test_training_blocks_equal_vllm_style_proposals_on_the_truncated_context():
    """A block trained at anchor a computes exactly what propose() (vLLM's schedule, checked
    against vLLM in test_vllm_parity) computes with the document's states before a as context."""
    torch.manual_seed(0)
    batch = packed_example()
    model = DFlashDrafter(tiny_config()).eval()
    start, end, pos, anchors, valid, ids, bpos, lo, hi = blocks_for(batch, model)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, bpos, model.fuse_context(batch.hidden_states), pos, lo, hi))
        for b, i in torch.nonzero(valid).tolist():
            a = int(anchors[b, i])
            s = int(start[b, a])
            _, ref = model.propose(
                batch.hidden_states[b : b + 1, s:a],
                batch.input_ids[b : b + 1, a],
                position_ids=pos[b : b + 1, s:a],
                return_logits=True,
            )
            torch.testing.assert_close(logits[b, i, 1:], ref[0], rtol=0, atol=1e-5)


def test_chunked_sdpa_path_equals_the_log_sum_exp_reference_across_chunks():
    from draftflow.models.dflash.attention import dflash_attention_chunked, dflash_attention_merged

    torch.manual_seed(3)
    bt, a, b, nh, nkv, hd, t = 2, 37, 4, 6, 2, 16, 300
    q = torch.randn(bt, a, b, nh, hd, requires_grad=True)
    k, v = (
        torch.randn(bt, a, b, nkv, hd, requires_grad=True),
        torch.randn(bt, a, b, nkv, hd, requires_grad=True),
    )
    ck, cv = torch.randn(bt, t, nkv, hd, requires_grad=True), torch.randn(bt, t, nkv, hd, requires_grad=True)
    hi = torch.sort(torch.randint(0, t, (bt, a)), dim=1).values
    lo = torch.minimum(hi, torch.randint(0, 50, (bt, a)))
    ref = dflash_attention_merged(q, k, v, ck, cv, lo, hi, 0.25)
    fast = dflash_attention_chunked(q, k, v, ck, cv, lo, hi, 0.25, max_chunk_queries=4 * 5)  # 8 chunks
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # every input's gradient: the fast path's backward is hand-written (window_attention.py),
    # and the context keys collect gradient from several overlapping chunks
    weights = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * weights).sum(), (q, k, v, ck, cv))
    g_fast = torch.autograd.grad((fast * weights).sum(), (q, k, v, ck, cv))
    for fast_g, ref_g in zip(g_fast, g_ref):
        torch.testing.assert_close(fast_g, ref_g, rtol=1e-4, atol=1e-5)


def _grads(out, weights, leaves):
    return torch.autograd.grad((out * weights).sum(), leaves)


def test_shared_range_split_equals_the_reference_with_gradient():
    """A chunk's shared context range scored unmasked in its own kernel call and merged by
    log-sum-exp (window_attention._Chunk) gives the single-call values and gradients: blocks
    whose windows start at different document starts (masked keys on both sides of the
    shared range) and, without extra keys, causal queries that see none of the masked keys."""
    from draftflow.models.window_attention import _chunks, grouped_window_attention

    torch.manual_seed(5)
    bt, a, b, nh, nkv, hd, t = 2, 40, 4, 6, 2, 16, 400
    leaves = [
        torch.randn(bt, a * b, nh, hd, requires_grad=True),
        *(torch.randn(bt, t, nkv, hd, requires_grad=True) for _ in range(2)),
        *(torch.randn(bt, a * b, nkv, hd, requires_grad=True) for _ in range(2)),
    ]
    q, ck, cv, k, v = leaves
    hi = torch.sort(torch.randint(150, t, (bt, a)), dim=1).values.repeat_interleave(b, 1)
    lo = torch.randint(0, 60, (bt, a)).repeat_interleave(b, 1)
    assert any(c.split and c.c0 > c.k0 for c in _chunks(lo, hi, t, b, 20, 1))
    ref = dflash_attention_merged(
        q.view(bt, a, b, nh, hd), k.view(bt, a, b, nkv, hd), v.view(bt, a, b, nkv, hd), ck, cv,
        lo[:, ::b], hi[:, ::b], 0.25,
    ).reshape(bt, a * b, nh, hd)  # fmt: skip
    weights = torch.randn_like(ref)
    g_ref = _grads(ref, weights, leaves)
    for min_shared in (1, 10**9):  # split in every chunk / in none
        fast = grouped_window_attention(q, ck, cv, lo, hi, k, v, b, b, 0.25, 20, min_shared)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        for g_fast, g in zip(_grads(fast, weights, leaves), g_ref):
            torch.testing.assert_close(g_fast, g, rtol=1e-4, atol=1e-5)

    # causal, no extra keys: the first query of a chunk sees only the shared range
    n = 40
    lo, hi = torch.zeros(1, n, dtype=torch.long), torch.arange(1, n + 1)[None]
    q, ck, cv = (torch.randn(1, n, h, 8, requires_grad=True) for h in (4, 2, 2))
    visible = torch.arange(n)[None, :] < hi[0, :, None]
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        ck.transpose(1, 2),
        cv.transpose(1, 2),
        attn_mask=visible,
        scale=0.3,
        enable_gqa=True,
    ).transpose(1, 2)
    fast = grouped_window_attention(q, ck, cv, lo, hi, None, None, 1, 0, 0.3, 8, 1)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(ref)
    for g_fast, g in zip(_grads(fast, weights, (q, ck, cv)), _grads(ref, weights, (q, ck, cv))):
        torch.testing.assert_close(g_fast, g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("forward_on_workers", [False, True])
def test_backward_on_worker_threads_equals_the_reference_and_is_deterministic(
    monkeypatch, forward_on_workers
):
    """With more than one intra-op thread the chunks' backward runs on worker threads, one
    intra-op thread each (window_attention._workers), each adding into a key-gradient
    buffer of its own; large calls' forward too (window_attention._forward_workers). Same
    values and gradients as the merged reference, bit-identical from run to run, and the
    caller's thread count is left as it was."""
    from draftflow.models import window_attention
    from draftflow.models.window_attention import (
        _chunks,
        _forward_workers,
        _shares,
        _workers,
        grouped_window_attention,
    )

    if forward_on_workers:
        monkeypatch.setattr(window_attention, "FORWARD_WORKERS_MIN_PAIRS", 0)

    torch.manual_seed(11)
    a, b, nh, nkv, hd, t = 30, 4, 9, 3, 16, 500
    leaves = [
        torch.randn(1, a * b, nh, hd, requires_grad=True),
        *(torch.randn(1, t, nkv, hd, requires_grad=True) for _ in range(2)),
        *(torch.randn(1, a * b, nkv, hd, requires_grad=True) for _ in range(2)),
    ]
    q, ck, cv, k, v = leaves
    hi = torch.sort(torch.randint(100, t, (1, a)), dim=1).values.repeat_interleave(b, 1)
    lo = torch.randint(0, 40, (1, a)).repeat_interleave(b, 1)
    ref = dflash_attention_merged(
        q.view(1, a, b, nh, hd), k.view(1, a, b, nkv, hd), v.view(1, a, b, nkv, hd), ck, cv,
        lo[:, ::b], hi[:, ::b], 0.25,
    ).reshape(1, a * b, nh, hd)  # fmt: skip
    weights = torch.randn_like(ref)
    g_ref = _grads(ref, weights, leaves)
    chunks = _chunks(lo, hi, t, b, 5 * b, 1)
    threads = torch.get_num_threads()
    try:
        for n_threads in (2, 3, 1):
            torch.set_num_threads(n_threads)
            assert _workers(len(chunks)) == n_threads
            assert _forward_workers(chunks) == (n_threads if forward_on_workers else 1)
            shares = _shares(chunks, n_threads)
            assert sorted(c.s for s in shares for c in s) == [c.s for c in chunks]  # each chunk once
            runs = []
            for _ in range(2):
                fast = grouped_window_attention(q, ck, cv, lo, hi, k, v, b, b, 0.25, 5 * b, 1)
                torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
                runs.append(_grads(fast, weights, leaves))
                assert torch.get_num_threads() == n_threads
            for g_fast, g_again, g in zip(*runs, g_ref):
                torch.testing.assert_close(g_fast, g, rtol=1e-4, atol=1e-5)
                assert torch.equal(g_fast, g_again)
    finally:
        torch.set_num_threads(threads)


def test_chunk_size_follows_the_mean_window():
    from draftflow.models.dflash.attention import chunk_queries

    zero = torch.zeros(1, 8, dtype=torch.long)
    assert chunk_queries(zero, zero + 500) == 64  # short windows: small chunks
    assert chunk_queries(zero, zero + 3200) == 200
    assert chunk_queries(zero, zero + 8000) == 256
    assert chunk_queries(zero[:, :0], zero[:, :0]) == 64
