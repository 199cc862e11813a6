"""Grouped window attention on CPU: fused flash-attention kernels per chunk of queries, with a
hand-written backward that accumulates into full-size gradients in place.

Both drafters' CPU attention has the same shape: query i sees a contiguous range of shared
context keys ``lo[i] <= j < hi[i]`` plus the few "extra" keys of its own group (DFlash: the B
keys of its block, non-causal; Eagle3: the earlier TTT steps' keys at its own index). Queries
are cut into chunks; a chunk scores the context window its queries span in fused kernel
calls, so no ``[Q, T]`` tensor ever exists: the range of the window that all its queries see
in one unmasked call over views of the context, the window's edges in one call under a mask
``[chunk queries, edge keys]`` (:class:`_Chunk`). The extra keys are scored per group by
batched matmuls over all groups at once (:func:`_group_attention`): in a chunk's kernel call
each query would score every group's extra keys and mask out all but its own (at 8k tokens ×
1,024 anchors, 36 blocks a chunk: 2.0M of 35.4M scored pairs, 35 in 36 wasted). The parts
merge by log-sum-exp.

Why an ``autograd.Function`` and not SDPA per chunk under autograd: autograd would keep every
chunk's concatenated edge keys, values and mask alive until backward, and the backward of
each chunk's window slice would allocate, zero and add a full ``[T, kv heads, head dim]``
gradient. Here only the inputs, the output and the log-sum-exp are kept; backward rebuilds each
chunk's keys and adds its key gradient into one buffer. The kernels are ATen's own
``_scaled_dot_product_flash_attention_for_cpu`` (the fused path SDPA dispatches to on CPU) and
its backward: same numerics as ``F.scaled_dot_product_attention``. The backward (and the
forward of large calls) runs whole chunks side by side on worker threads (one intra-op thread
each, :func:`_workers`): the kernel alone splits a backward call over its 9 heads only.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from draftflow.models.common import dense_attention_lse

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# A chunk's shared context range (keys every one of its queries sees) goes to its own kernel
# call, without mask, from this many keys up: below it the second call's fixed cost outweighs
# the saving (see _Chunk).
MIN_SHARED_KEYS = 256
# From this many scored query-key pairs (all chunks) the forward runs on worker threads too.
FORWARD_WORKERS_MIN_PAIRS = 4_000_000


@dataclass(frozen=True)
class _Chunk:
    """One chunk of whole groups: queries [s, e), groups [g0, g1), context window [k0, k1).

    [c0, c1) is the part of the window that every query of the chunk sees (c0 = c1 = k1 when
    it is not split off). It is scored by a kernel call of its own with no mask, over views of
    the context (no copy): with sorted anchors or causal prefixes that is almost the whole
    window at long contexts, and the unmasked kernel skips the mask add, the mask is never
    built for it, and the keys are not concatenated. The rest ([k0, c0) and [c1, k1)) is
    scored under a mask; the results merge by log-sum-exp.
    """

    s: int
    e: int
    g0: int
    g1: int
    k0: int
    k1: int
    c0: int
    c1: int

    @property
    def split(self) -> bool:
        return self.c1 > self.c0

    def shared(self, ctx_k: Tensor, ctx_v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys/values [Bt, kv heads, c1 - c0, hd] of the shared range: views, no copy."""
        return ctx_k[:, self.c0 : self.c1].transpose(1, 2), ctx_v[:, self.c0 : self.c1].transpose(1, 2)


def _chunks(lo, hi, t, group_q, max_chunk_queries, min_shared):
    """The chunks of ``max_chunk_queries // group_q`` whole groups each, with their windows."""
    per = max(1, max_chunk_queries // group_q)
    groups = lo.shape[1] // group_q
    # one host sync (tolist) for all chunks' window bounds, not four per chunk
    starts = list(range(0, groups, per))
    bounds = []
    for g0 in starts:
        s, e = g0 * group_q, min(groups, g0 + per) * group_q
        lo_c, hi_c = lo[:, s:e].clamp(0, t), hi[:, s:e].clamp(0, t)
        bounds.append(torch.stack([lo_c.min(), hi_c.max(), lo_c.max(), hi_c.min()]))
    out = []
    for g0, (k0, k1, c0, c1) in zip(starts, torch.stack(bounds).tolist() if bounds else []):
        g1 = min(groups, g0 + per)
        k1 = max(k0, k1)
        if c1 - c0 < min_shared:
            c0 = c1 = k1
        out.append(_Chunk(g0 * group_q, g1 * group_q, g0, g1, k0, k1, c0, c1))
    return out


def _masked_keys(ctx_k, ctx_v, ek, ev, lo, hi, c: _Chunk, group_q, group_k, dtype):
    """The masked part of chunk ``c``: keys/values [Bt, kv heads, n, hd] over the context
    outside its shared range ([k0, c0) ; [c1, k1)) and, when ``ek`` is given, its groups'
    extra keys, the float mask [Bt, 1, queries, n] and whether each query [Bt, queries] sees
    any of them."""
    dev = lo.device
    idx = torch.cat([torch.arange(c.k0, c.c0, device=dev), torch.arange(c.c1, c.k1, device=dev)])
    lo_c, hi_c = lo[:, c.s : c.e, None], hi[:, c.s : c.e, None]
    visible = (idx >= lo_c) & (idx < hi_c)  # [Bt, n, W']
    keys = [ctx_k[:, c.k0 : c.c0], ctx_k[:, c.c1 : c.k1]]
    values = [ctx_v[:, c.k0 : c.c0], ctx_v[:, c.c1 : c.k1]]
    if ek is not None and group_k:
        e0, e1 = c.g0 * group_k, c.g1 * group_k
        owner_q = torch.arange(c.e - c.s, device=dev) // group_q
        owner_k = torch.arange(e1 - e0, device=dev) // group_k
        own = (owner_q[:, None] == owner_k[None, :]).expand(visible.shape[0], -1, -1)
        visible = torch.cat([visible, own], -1)
        keys.append(ek[:, e0:e1])
        values.append(ev[:, e0:e1])
    keys, values = [x for x in keys if x.shape[1]], [x for x in values if x.shape[1]]
    keys = torch.cat(keys, 1) if len(keys) > 1 else keys[0] if keys else None
    values = torch.cat(values, 1) if len(values) > 1 else values[0] if values else None
    if keys is None:
        return None, None, None, None
    zero, ninf = (
        torch.zeros((), dtype=dtype, device=dev),
        torch.full((), float("-inf"), dtype=dtype, device=dev),
    )
    mask = torch.where(visible, zero, ninf)[:, None]
    return keys.transpose(1, 2), values.transpose(1, 2), mask, visible.any(-1)


def _to_groups(x: Tensor, group: int, kv_heads: int) -> Tensor:
    """[Bt, G·group, heads, hd] → [Bt·G·kv heads, (heads / kv heads)·group, hd]: each group's
    rows per key head, the query heads that share it side by side (SDPA's GQA layout: query
    head h reads key head h // (heads / kv heads))."""
    bt, n, heads, hd = x.shape
    x = x.view(bt, n // group, group, kv_heads, heads // kv_heads, hd)
    return x.permute(0, 1, 3, 4, 2, 5).reshape(-1, heads // kv_heads * group, hd)


def _from_groups(x: Tensor, bt: int, group: int, heads: int) -> Tensor:
    """The inverse of :func:`_to_groups` for ``heads`` query heads: [Bt, G·group, heads, hd]."""
    m, rows, hd = x.shape
    rep = rows // group
    x = x.view(bt, m // bt // (heads // rep), heads // rep, rep, group, hd)
    return x.permute(0, 1, 4, 2, 3, 5).reshape(bt, -1, heads, hd)


def _lse_to_groups(lse: Tensor, group: int, kv_heads: int) -> Tensor:
    """[Bt, heads, G·group] → [Bt·G·kv heads, (heads / kv heads)·group], rows as in :func:`_to_groups`."""
    bt, heads, n = lse.shape
    x = lse.view(bt, kv_heads, heads // kv_heads, n // group, group)
    return x.permute(0, 3, 1, 2, 4).reshape(-1, heads // kv_heads * group)


def _group_attention(q, ek, ev, group_q, group_k, scale):
    """Each group's queries over its own extra keys, dense (a few keys each: batched matmuls,
    not a flash call in which a chunk's other groups' keys would be scored and masked out):
    out [Bt, N, nh, hd], lse [Bt, nh, N]."""
    bt, n, nh, hd = q.shape
    groups, nkv = n // group_q, ek.shape[2]
    out, lse = dense_attention_lse(
        q.reshape(bt * groups, group_q, nh, hd),
        ek.reshape(bt * groups, group_k, nkv, hd),
        ev.reshape(bt * groups, group_k, nkv, hd),
        torch.ones(1, group_q, group_k, dtype=torch.bool, device=q.device),
        scale,
    )
    return out.reshape(bt, n, nh, hd), lse.reshape(bt, n, nh).transpose(1, 2)


def _group_attention_backward(grad_out, q, ek, ev, out, lse, group_q, group_k, scale):
    """(dq, d extra keys, d extra values) of :func:`_group_attention`'s part of an attention
    whose merged output and log-sum-exp are ``out`` / ``lse``: P = exp(scores - lse) and
    rowsum(dO · O) are the full softmax's, so this is the extra keys' share of the gradient."""
    bt, n, nh, hd = q.shape
    nkv = ek.shape[2]
    qg, kg, vg = _to_groups(q, group_q, nkv), _to_groups(ek, group_k, nkv), _to_groups(ev, group_k, nkv)
    go = _to_groups(grad_out, group_q, nkv)
    rowsum = _lse_to_groups((grad_out * out).sum(-1).transpose(1, 2), group_q, nkv)
    scores = torch.bmm(qg, kg.transpose(1, 2)).mul_(scale)
    p = scores.sub_(_lse_to_groups(lse, group_q, nkv)[..., None]).exp_()
    dv = torch.bmm(p.transpose(1, 2), go)
    ds = torch.bmm(go, vg.transpose(1, 2)).sub_(rowsum[..., None]).mul_(p).mul_(scale)
    dq = _from_groups(torch.bmm(ds, kg), bt, group_q, nh)
    dk = torch.bmm(ds.transpose(1, 2), qg)
    return dq, _from_groups(dk, bt, group_k, nkv), _from_groups(dv, bt, group_k, nkv)


def _sdpa_chunks(q, ctx_k, ctx_v, ek, ev, lo, hi, group_q, group_k, scale, max_chunk_queries):
    outs = []
    # one masked call per chunk (no shared-range split): SDPA under autograd
    for c in _chunks(lo, hi, ctx_k.shape[1], group_q, max_chunk_queries, min_shared=ctx_k.shape[1] + 1):
        keys, values, mask, _ = _masked_keys(ctx_k, ctx_v, ek, ev, lo, hi, c, group_q, group_k, q.dtype)
        out = F.scaled_dot_product_attention(
            q[:, c.s : c.e].transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, 1)


def _merge(out_a, lse_a, out_b, lse_b):
    """Two attentions of the same queries over disjoint key sets → the attention over both
    (out [Bt, nh, n, hd], lse [Bt, nh, n])."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - lse).exp_()[..., None]
    return out.addcmul_(out_b, (lse_b - lse).exp_()[..., None]), lse


class _GroupedWindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, ctx_k, ctx_v, ek, ev, lo, hi, group_q, group_k, scale, max_chunk_queries, min_shared):
        bt, nq, nh, hd = q.shape
        out = q.new_empty(bt, nq, nh, hd)
        lse = torch.empty(bt, nh, nq, dtype=torch.float32, device=q.device)
        chunks = _chunks(lo, hi, ctx_k.shape[1], group_q, max_chunk_queries, min_shared)
        extra = _group_attention(q, ek, ev, group_q, group_k, scale) if group_k else None
        inputs = (q, ctx_k, ctx_v, lo, hi, group_q, scale)
        shares = _shares(chunks, _forward_workers(chunks))
        # chunks write disjoint rows of out and lse
        _on_workers(shares, lambda i, share: _chunks_forward(share, inputs, extra, out, lse))
        ctx.save_for_backward(q, ctx_k, ctx_v, ek, ev, lo, hi, out, lse)
        ctx.args = (group_q, group_k, scale, chunks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, ctx_k, ctx_v, ek, ev, lo, hi, out, lse = ctx.saved_tensors
        group_q, group_k, scale, chunks = ctx.args
        grad_out = grad_out.contiguous()
        if group_k:
            dq, dek, dev = _group_attention_backward(grad_out, q, ek, ev, out, lse, group_q, group_k, scale)
        else:
            dq, dek, dev = torch.zeros_like(q), None, None
        grads = _Grads(dq, torch.zeros_like(ctx_k), torch.zeros_like(ctx_v))
        saved = (grad_out, q, ctx_k, ctx_v, lo, hi, out, lse, group_q, scale)
        shares = _shares(chunks, _workers(len(chunks)))
        # every worker past the first adds its context-key gradient into a buffer of its own,
        # summed at the end; query rows of different chunks are disjoint
        own = [grads] + [
            _Grads(grads.q, torch.zeros_like(ctx_k), torch.zeros_like(ctx_v)) for _ in shares[1:]
        ]
        _on_workers(shares, lambda i, share: _chunks_backward(share, saved, own[i]))
        for g in own[1:]:
            grads.ctx_k += g.ctx_k
            grads.ctx_v += g.ctx_v
        return grads.q, grads.ctx_k, grads.ctx_v, dek, dev, *(None,) * 7


def _chunks_forward(chunks, inputs, extra, out: Tensor, lse: Tensor) -> None:
    """Forward of ``chunks``: writes their rows of ``out`` [Bt, nq, nh, hd] and ``lse``, each
    chunk's context parts merged with its rows of ``extra`` (the groups' own keys' output
    and log-sum-exp, or None)."""
    q, ctx_k, ctx_v, lo, hi, group_q, scale = inputs
    for c in chunks:
        qc = q[:, c.s : c.e].transpose(1, 2)
        parts = []
        if c.split:
            parts.append(_flash(qc, *c.shared(ctx_k, ctx_v), scale=scale)[:2])
        keys, values, mask, seen = _masked_keys(ctx_k, ctx_v, None, None, lo, hi, c, group_q, 0, q.dtype)
        if keys is not None:
            o, lse_c = _flash(qc, keys, values, attn_mask=mask, scale=scale)[:2]
            # a query that sees none of the masked keys: the kernel reports lse 0, not -inf
            parts.append((o, lse_c.masked_fill_(~seen[:, None], float("-inf"))))
        if extra is not None:
            parts.append((extra[0][:, c.s : c.e].transpose(1, 2), extra[1][:, :, c.s : c.e]))
        o, lse_c = parts[0]
        for o_p, lse_p in parts[1:]:
            o, lse_c = _merge(o, lse_c, o_p, lse_p)
        out[:, c.s : c.e] = o.transpose(1, 2)
        lse[:, :, c.s : c.e] = lse_c


@dataclass
class _Grads:
    q: Tensor
    ctx_k: Tensor
    ctx_v: Tensor


def _chunks_backward(chunks, saved, g: _Grads) -> None:
    """Backward of ``chunks``' context parts: adds into their query rows of ``g.q`` and into
    the context-key gradients ``g.ctx_k`` / ``g.ctx_v``."""
    grad_out, q, ctx_k, ctx_v, lo, hi, out, lse, group_q, scale = saved
    for c in chunks:
        # Each part's backward with the merged output and log-sum-exp is that part's share
        # of the gradient: P = exp(scores - lse) and rowsum(dO · O) are the full softmax's.
        go, qc = grad_out[:, c.s : c.e].transpose(1, 2), q[:, c.s : c.e].transpose(1, 2)
        oc, lc = out[:, c.s : c.e].transpose(1, 2), lse[:, :, c.s : c.e]
        dq = g.q[:, c.s : c.e].transpose(1, 2)
        keys, values, mask, _ = _masked_keys(ctx_k, ctx_v, None, None, lo, hi, c, group_q, 0, q.dtype)
        if keys is not None:
            dq_m, dk, dv = _flash_backward(
                go, qc, keys, values, oc, lc, 0.0, False, attn_mask=mask, scale=scale
            )
            # dk/dv rows follow the masked keys' order: [k0, c0) ; [c1, k1)
            w0 = c.c0 - c.k0
            g.ctx_k[:, c.k0 : c.c0] += dk[:, :, :w0].transpose(1, 2)
            g.ctx_v[:, c.k0 : c.c0] += dv[:, :, :w0].transpose(1, 2)
            g.ctx_k[:, c.c1 : c.k1] += dk[:, :, w0:].transpose(1, 2)
            g.ctx_v[:, c.c1 : c.k1] += dv[:, :, w0:].transpose(1, 2)
            dq += dq_m
        if c.split:
            dq_s, dk, dv = _flash_backward(go, qc, *c.shared(ctx_k, ctx_v), oc, lc, 0.0, False, scale=scale)
            g.ctx_k[:, c.c0 : c.c1] += dk.transpose(1, 2)
            g.ctx_v[:, c.c0 : c.c1] += dv.transpose(1, 2)
            dq += dq_s


def _forward_workers(chunks: list[_Chunk]) -> int:
    """Worker threads for the forward: as for the backward from ``FORWARD_WORKERS_MIN_PAIRS``
    scored pairs up, else 1 (inline: the kernel splits a forward call over query blocks as
    well as heads). Below the threshold starting the threads costs more than the split gains;
    above it the workers win a little (bench/train.py)."""
    if sum(_cost(c) for c in chunks) < FORWARD_WORKERS_MIN_PAIRS:
        return 1
    return _workers(len(chunks))


def _workers(n_chunks: int) -> int:
    """How many threads run whole chunks side by side, one intra-op thread each.

    ATen's CPU flash backward splits one call over (batch entry, query head) only: 9 heads on
    2 threads leave one thread idle for a ninth of every call, plus the kernel's own serial
    parts, so a second thread gains far less than 2x; whole chunks on separate threads keep
    every thread busy. Needs ATen's OpenMP backend, where the intra-op thread count belongs to
    the calling thread."""
    threads = torch.get_num_threads()
    if threads == 1 or n_chunks < 2 or "parallel backend: OpenMP" not in _parallel_info():
        return 1
    return min(threads, n_chunks)


@functools.cache
def _parallel_info() -> str:
    return torch.__config__.parallel_info()


def _cost(c: _Chunk) -> int:
    """Query-key pairs chunk ``c`` scores in its kernel calls."""
    return (c.e - c.s) * (c.k1 - c.k0)


def _shares(chunks: list[_Chunk], workers: int) -> list[list[_Chunk]]:
    """Chunks dealt to ``workers`` by estimated cost (queries × keys scored), largest first to
    the least loaded: deterministic, so each worker's gradient sums in a fixed order."""
    loads, shares = [0] * workers, [[] for _ in range(workers)]
    for c in sorted(chunks, key=_cost, reverse=True):
        w = loads.index(min(loads))
        shares[w].append(c)
        loads[w] += _cost(c)
    return [sorted(s, key=lambda c: c.s) for s in shares if s]


def _on_workers(shares: list[list[_Chunk]], work) -> None:
    """``work(i, shares[i])`` for every share: inline for one, else one thread per share with
    one intra-op thread each (the caller's thread count is restored after)."""
    if len(shares) == 1:
        work(0, shares[0])
        return
    threads = torch.get_num_threads()

    def run(i, share):
        torch.set_num_threads(1)
        with torch.no_grad():  # grad mode is per thread: a worker starts with it on
            work(i, share)

    try:
        with ThreadPoolExecutor(len(shares)) as pool:
            for done in [pool.submit(run, i, share) for i, share in enumerate(shares)]:
                done.result()
    finally:
        torch.set_num_threads(threads)  # also the process-wide default a new thread starts with


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
    min_shared_keys: int = MIN_SHARED_KEYS,
) -> Tensor:
    """q [Bt, G·group_q, nh, hd]; ctx_k/ctx_v [Bt, T, nkv, hd]; lo/hi [Bt, G·group_q];
    extra_k/extra_v [Bt, G·group_k, nkv, hd] or None. Query i sees context keys
    ``lo[i] <= j < hi[i]`` and the extra keys of its group (``j // group_k == i // group_q``).
    Every query must see at least one key. Returns [Bt, G·group_q, nh, hd].

    Chunks hold whole groups, about ``max_chunk_queries`` queries each: the kernel scores
    every key of a chunk's window, so small chunks keep the masked-out share small when
    windows grow with the query index (sorted anchors, causal prefixes). A chunk's shared
    range of at least ``min_shared_keys`` keys is scored unmasked on its own (:class:`_Chunk`)."""
    if extra_k is None:
        group_k = 0
    if q.device.type != "cpu":  # the kernels are CPU ones: SDPA per chunk under autograd
        return _sdpa_chunks(
            q, ctx_k, ctx_v, extra_k, extra_v, lo, hi, group_q, group_k, scale, max_chunk_queries
        )
    return _GroupedWindowAttention.apply(
        q, ctx_k, ctx_v, extra_k, extra_v, lo, hi, group_q, group_k, scale, max_chunk_queries, min_shared_keys
    )
