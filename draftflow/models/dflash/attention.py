"""DFlash attention: each block's queries see their document's context before the anchor
plus every token of their own block (non-causal), nothing else.

Who sees what (matches vLLM 0.32 ``DFlashProposer``): for a block anchored at packed index
``a`` (the anchor token's own position is ``pos[a]``), the context keys are the target
states at indices ``doc_start(a) <= t < a`` — the anchor's own state is *not* included
(at inference the anchor is the bonus token the target has not processed yet, so its state
does not exist; vLLM's context is every token up to ``last_pos`` and the block starts at
``last_pos + 1``). Block keys: the B tokens of the same block, in both directions.

Implementations, same result (tested against a naive per-query loop):
- ``"dense"`` (CPU): fused SDPA per chunk of anchors over ``[context window ; the chunk's
  blocks]`` (:func:`dflash_attention_chunked`); cost linear in the number of anchors, no
  ``[A·B, A·B]`` or ``[A·B, T + A·B]`` tensor is ever built.
- :func:`dflash_attention_merged`: the same split written out — block→context range
  attention and in-block attention merged exactly by their log-sum-exp; kept as the
  readable reference the fast path is tested against.
- ``"flex"``: one ``flex_attention`` call over the keys ``[context ; all blocks]`` with a
  block mask encoding both rules (block-sparse, compiled on GPU; forward-only on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftflow.models.common import (
    AttentionImpl,
    dense_attention_lse,
    flex_attention_fn,
    merge_attention,
    range_attention_dense,
)
from draftflow.models.window_attention import grouped_window_attention


def block_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Non-causal attention inside each block.

    q: [Bt, A, Bq, nh, hd] (Bq <= B: the block's last Bq slots); k, v: [Bt, A, B, nkv, hd]
    → out [Bt, A, Bq, nh, hd], lse [Bt, A, Bq, nh].
    """
    bt, a, bq, nh, hd = q.shape
    b, nkv = k.shape[2], k.shape[-2]
    visible = torch.ones(1, bq, b, dtype=torch.bool, device=q.device)
    out, lse = dense_attention_lse(
        q.reshape(bt * a, bq, nh, hd),
        k.reshape(bt * a, b, nkv, hd),
        v.reshape(bt * a, b, nkv, hd),
        visible,
        scale,
    )
    return out.view(bt, a, bq, nh, hd), lse.view(bt, a, bq, nh)


def dflash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx_k: Tensor,
    ctx_v: Tensor,
    lo: Tensor,
    hi: Tensor,
    scale: float,
    impl: AttentionImpl = "dense",
) -> Tensor:
    """q: [Bt, A, Bq, nh, hd]; k, v: [Bt, A, B, nkv, hd] (the blocks' own keys);
    ctx_k, ctx_v: [Bt, T, nkv, hd]; lo, hi: [Bt, A] context index range of each block.
    Returns [Bt, A, Bq, nh, hd]. Bq < B: queries of only some slots (the last layer needs
    no output at the anchor slot), every slot still a key."""
    if impl == "flex":
        return dflash_attention_flex(q, k, v, ctx_k, ctx_v, lo, hi, scale)
    return dflash_attention_chunked(q, k, v, ctx_k, ctx_v, lo, hi, scale)


def dflash_attention_merged(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx_k: Tensor,
    ctx_v: Tensor,
    lo: Tensor,
    hi: Tensor,
    scale: float,
) -> Tensor:
    """Reference formulation: block→context and in-block attention merged by log-sum-exp."""
    bt, a, bq, nh, hd = q.shape
    # (a) block -> context: A·Bq queries, each block's slots share its range [lo, hi)
    out_c, lse_c = range_attention_dense(
        q.reshape(bt, a * bq, nh, hd),
        ctx_k,
        ctx_v,
        lo.repeat_interleave(bq, 1),
        hi.repeat_interleave(bq, 1),
        scale,
    )
    # (b) in-block
    out_b, lse_b = block_attention(q, k, v, scale)
    return merge_attention(out_c.view(bt, a, bq, nh, hd), lse_c.view(bt, a, bq, nh), out_b, lse_b)


def dflash_attention_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx_k: Tensor,
    ctx_v: Tensor,
    lo: Tensor,
    hi: Tensor,
    scale: float,
    max_chunk_queries: int | None = None,
) -> Tensor:
    """The CPU path: fused flash-attention calls per chunk of anchors over its context window
    (:func:`~draftflow.models.window_attention.grouped_window_attention`, groups = blocks):
    the context range all its blocks see unmasked, the window's edges under a mask [c·B,
    edges], and each block's queries over its own B keys by batched matmuls, all merged by
    log-sum-exp. The total cost is linear in the number of anchors for a fixed chunk size
    and no [A·B, T + A·B] tensor exists. Every query sees at least its own block.

    Chunk size (``max_chunk_queries``, default :func:`chunk_queries`): the kernel scores every
    key it is given, and a chunk's edge keys (the span of its anchors) are partly masked
    out, so that overhead grows with the chunk; larger chunks run the kernel at a higher rate
    and pay fewer calls. The shared range itself is scored unmasked (``window_attention._Chunk``).
    """
    bt, a, bq, nh, hd = q.shape
    if max_chunk_queries is None:
        max_chunk_queries = chunk_queries(lo, hi)
    b, nkv = k.shape[2], ctx_k.shape[2]
    out = grouped_window_attention(
        q.reshape(bt, a * bq, nh, hd),
        ctx_k,
        ctx_v,
        lo.repeat_interleave(bq, 1),
        hi.repeat_interleave(bq, 1),
        k.reshape(bt, a * b, nkv, hd),
        v.reshape(bt, a * b, nkv, hd),
        bq,
        b,
        scale,
        max_chunk_queries,
    )
    return out.view(bt, a, bq, nh, hd)


def chunk_queries(lo: Tensor, hi: Tensor) -> int:
    """Queries per chunk for :func:`dflash_attention_chunked`: 1/16 of the mean context
    window, within [64, 256]. Short windows want small chunks (the masked share of each chunk is
    larger), long ones larger; nothing between 64 and 512 beat this rule in bench/train.py."""
    mean_window = float((hi - lo).clamp_min(0).float().mean()) if lo.numel() else 0.0
    return int(min(256, max(64, mean_window / 16)))


def dflash_mask_mod(
    lo: Tensor, hi: Tensor, block_size: int, context_len: int, query_slots: int | None = None
):
    """flex mask over keys [context (T) ; block 0 ; block 1 ; ...] for queries [block 0 ; ...]
    (``query_slots`` queries per block, default all ``block_size``)."""
    per_q = query_slots or block_size

    def mask_mod(b, h, qi, ki):
        blk = qi // per_q
        in_ctx = (ki < context_len) & (ki >= lo[b, blk]) & (ki < hi[b, blk])
        in_blk = (ki >= context_len) & ((ki - context_len) // block_size == blk)
        return in_ctx | in_blk

    return mask_mod


def dflash_attention_flex(
    q: Tensor, k: Tensor, v: Tensor, ctx_k: Tensor, ctx_v: Tensor, lo: Tensor, hi: Tensor, scale: float
) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    bt, a, bq, nh, hd = q.shape
    b, t, nkv = k.shape[2], ctx_k.shape[1], ctx_k.shape[2]
    qf = q.reshape(bt, a * bq, nh, hd).transpose(1, 2)  # [Bt, nh, A·Bq, hd]
    kf = torch.cat([ctx_k, k.reshape(bt, a * b, nkv, hd)], 1).transpose(1, 2)  # [Bt, nkv, T+A·B, hd]
    vf = torch.cat([ctx_v, v.reshape(bt, a * b, nkv, hd)], 1).transpose(1, 2)
    mask = create_block_mask(
        dflash_mask_mod(lo, hi, b, t, bq),
        bt,
        None,
        a * bq,
        t + a * b,
        device=q.device,
        _compile=q.device.type != "cpu",
    )
    out = flex_attention_fn(q.device)(qf, kf, vf, block_mask=mask, scale=scale, enable_gqa=nh != nkv)
    return out.transpose(1, 2).reshape(bt, a, bq, nh, hd)
