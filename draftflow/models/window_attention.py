"""Grouped window attention on CPU: fused flash-attention kernels per chunk of queries, with a
hand-written backward that accumulates into full-size gradients in place.

Both drafters' CPU attention has the same shape: query i sees a contiguous range of shared
context keys ``lo[i] <= j < hi[i]`` plus the few "extra" keys of its own group (DFlash: the B
keys of its block, non-causal; Eagle3: the earlier TTT steps' keys at its own index). Queries
are cut into chunks; a chunk scores the context window its queries span plus its groups' extra
keys under one mask ``[chunk queries, window + chunk extra keys]`` in one fused kernel call, so
no ``[Q, T]`` tensor ever exists and one softmax covers both key sets.

Why an ``autograd.Function`` and not SDPA per chunk under autograd: autograd would keep every
chunk's concatenated ``[window ; extra]`` keys and values alive until backward (at 8k tokens ×
1,024 anchors about as much memory as the context itself per few chunks), and the backward of
each chunk's window slice would allocate, zero and add a full ``[T, kv heads, head dim]``
gradient. Here only the inputs, the output and the log-sum-exp are kept; backward rebuilds each
chunk's keys and adds its key gradient into one buffer. The kernels are ATen's own
``_scaled_dot_product_flash_attention_for_cpu`` (the fused path SDPA dispatches to on CPU) and
its backward: same numerics as ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _chunks(nq: int, group_q: int, max_chunk_queries: int):
    """(query start, query end, group start, group end) per chunk of whole groups."""
    per = max(1, max_chunk_queries // group_q)
    groups = nq // group_q
    for g0 in range(0, groups, per):
        g1 = min(groups, g0 + per)
        yield g0 * group_q, g1 * group_q, g0, g1


def _chunk_keys(ctx_k, ctx_v, ek, ev, lo, hi, s, e, g0, g1, group_q, group_k, dtype):
    """Keys/values [Bt, kv heads, W + n·group_k, hd] of one chunk, its float mask
    [Bt, 1, queries, keys] and its context window (k0, k1)."""
    t = ctx_k.shape[1]
    lo_c, hi_c = lo[:, s:e], hi[:, s:e]
    k0 = int(lo_c.min().clamp(0, t))
    k1 = max(k0, int(hi_c.max().clamp(0, t)))
    idx = torch.arange(k1 - k0, device=lo.device)
    visible = (idx >= (lo_c - k0)[..., None]) & (idx < (hi_c - k0)[..., None])  # [Bt, n, W]
    keys, values = ctx_k[:, k0:k1], ctx_v[:, k0:k1]
    if ek is not None and group_k:
        e0, e1 = g0 * group_k, g1 * group_k
        owner_q = torch.arange(e - s, device=lo.device) // group_q
        owner_k = torch.arange(e1 - e0, device=lo.device) // group_k
        own = (owner_q[:, None] == owner_k[None, :]).expand(visible.shape[0], -1, -1)
        visible = torch.cat([visible, own], -1)
        keys = torch.cat([keys, ek[:, e0:e1]], 1)
        values = torch.cat([values, ev[:, e0:e1]], 1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=lo.device).masked_fill_(~visible, float("-inf"))
    return keys.transpose(1, 2), values.transpose(1, 2), mask[:, None], k0, k1


def _sdpa_chunks(q, ctx_k, ctx_v, ek, ev, lo, hi, group_q, group_k, scale, max_chunk_queries):
    outs = []
    for s, e, g0, g1 in _chunks(q.shape[1], group_q, max_chunk_queries):
        keys, values, mask, _, _ = _chunk_keys(
            ctx_k, ctx_v, ek, ev, lo, hi, s, e, g0, g1, group_q, group_k, q.dtype
        )
        out = F.scaled_dot_product_attention(
            q[:, s:e].transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, 1)


class _GroupedWindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, ctx_k, ctx_v, ek, ev, lo, hi, group_q, group_k, scale, max_chunk_queries):
        bt, nq, nh, hd = q.shape
        out = q.new_empty(bt, nq, nh, hd)
        lse = torch.empty(bt, nh, nq, dtype=torch.float32, device=q.device)
        for s, e, g0, g1 in _chunks(nq, group_q, max_chunk_queries):
            keys, values, mask, _, _ = _chunk_keys(
                ctx_k, ctx_v, ek, ev, lo, hi, s, e, g0, g1, group_q, group_k, q.dtype
            )
            o, lse_c = _flash(q[:, s:e].transpose(1, 2), keys, values, attn_mask=mask, scale=scale)
            out[:, s:e] = o.transpose(1, 2)
            lse[:, :, s:e] = lse_c
        ctx.save_for_backward(q, ctx_k, ctx_v, ek, ev, lo, hi, out, lse)
        ctx.args = (group_q, group_k, scale, max_chunk_queries)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, ctx_k, ctx_v, ek, ev, lo, hi, out, lse = ctx.saved_tensors
        group_q, group_k, scale, max_chunk_queries = ctx.args
        grad_out = grad_out.contiguous()
        gq = torch.empty_like(q)
        gck, gcv = torch.zeros_like(ctx_k), torch.zeros_like(ctx_v)
        gek = torch.empty_like(ek) if ek is not None else None
        gev = torch.empty_like(ev) if ev is not None else None
        for s, e, g0, g1 in _chunks(q.shape[1], group_q, max_chunk_queries):
            keys, values, mask, k0, k1 = _chunk_keys(
                ctx_k, ctx_v, ek, ev, lo, hi, s, e, g0, g1, group_q, group_k, q.dtype
            )
            dq, dk, dv = _flash_backward(
                grad_out[:, s:e].transpose(1, 2),
                q[:, s:e].transpose(1, 2),
                keys,
                values,
                out[:, s:e].transpose(1, 2),
                lse[:, :, s:e],
                0.0,
                False,
                attn_mask=mask,
                scale=scale,
            )
            gq[:, s:e] = dq.transpose(1, 2)
            w = k1 - k0
            gck[:, k0:k1] += dk[:, :, :w].transpose(1, 2)
            gcv[:, k0:k1] += dv[:, :, :w].transpose(1, 2)
            if gek is not None and group_k:
                gek[:, g0 * group_k : g1 * group_k] = dk[:, :, w:].transpose(1, 2)
                gev[:, g0 * group_k : g1 * group_k] = dv[:, :, w:].transpose(1, 2)
        return gq, gck, gcv, gek, gev, None, None, None, None, None, None


def grouped_window_attention(
    q: Tensor,
    ctx_k: Tensor,
    ctx_v: Tensor,
    lo: Tensor,
    hi: Tensor,
    extra_k: Tensor | None,
    extra_v: Tensor | None,
    group_q: int,
    group_k: int,
    scale: float,
    max_chunk_queries: int = 128,
) -> Tensor:
    """q [Bt, G·group_q, nh, hd]; ctx_k/ctx_v [Bt, T, nkv, hd]; lo/hi [Bt, G·group_q];
    extra_k/extra_v [Bt, G·group_k, nkv, hd] or None. Query i sees context keys
    ``lo[i] <= j < hi[i]`` and the extra keys of its group (``j // group_k == i // group_q``).
    Every query must see at least one key. Returns [Bt, G·group_q, nh, hd].

    Chunks hold whole groups, about ``max_chunk_queries`` queries each: the kernel scores
    every key of a chunk's window, so small chunks keep the masked-out share small when
    windows grow with the query index (sorted anchors, causal prefixes)."""
    if extra_k is None:
        group_k = 0
    if q.device.type != "cpu":  # the kernels are CPU ones: SDPA per chunk under autograd
        return _sdpa_chunks(
            q, ctx_k, ctx_v, extra_k, extra_v, lo, hi, group_q, group_k, scale, max_chunk_queries
        )
    return _GroupedWindowAttention.apply(
        q, ctx_k, ctx_v, extra_k, extra_v, lo, hi, group_q, group_k, scale, max_chunk_queries
    )
