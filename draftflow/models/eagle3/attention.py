"""Eagle3 training-time-test (TTT) attention: what each unrolled step's query sees.

Unrolled step k (0-based) at packed index i stands for vLLM's draft step k when the target
has accepted everything up to index i (the anchor p = i):
- query position ``pos[i] + k``;
- keys of step 0 (computed from the *target's* fused states, like vLLM's first pass over
  the context) at indices ``doc_start(i) <= j <= i`` — causal, own document only;
- keys of steps 1..k at the *same* index i (positions ``pos[i] + 1 .. pos[i] + k``): in vLLM
  these are the KV-cache entries the previous draft steps wrote at p+1..p+k.
Never: step >= 1 keys at other indices (they belong to other anchors' drafts).

On CPU (``"dense"``) both key sets go into one fused SDPA call per chunk of queries
(:func:`ttt_attention_chunked`). With flex, the causal part is range attention and the
per-index part a tiny ``[k]`` attention, merged exactly by log-sum-exp, as in
EAGLE-3/SpecForge's "cache_hidden" attention but without materialising ``[T, T]`` scores.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftflow.models.common import AttentionImpl, dense_attention_lse, merge_attention, range_attention
from draftflow.models.window_attention import grouped_window_attention


def diagonal_attention(
    q: Tensor, keys: list[Tensor], values: list[Tensor], scale: float
) -> tuple[Tensor, Tensor]:
    """q [Bt, T, nh, hd] attends, per index, to that index's k previous-step keys.

    keys/values: k tensors [Bt, T, nkv, hd] → out [Bt, T, nh, hd], lse [Bt, T, nh].
    """
    bt, t, nh, hd = q.shape
    k = torch.stack(keys, 2)  # [Bt, T, k, nkv, hd]
    v = torch.stack(values, 2)
    n, nkv = k.shape[2], k.shape[3]
    visible = torch.ones(1, 1, n, dtype=torch.bool, device=q.device)
    out, lse = dense_attention_lse(
        q.reshape(bt * t, 1, nh, hd),
        k.reshape(bt * t, n, nkv, hd),
        v.reshape(bt * t, n, nkv, hd),
        visible,
        scale,
    )
    return out.view(bt, t, nh, hd), lse.view(bt, t, nh)


def ttt_attention(
    q: Tensor,
    k0: Tensor,
    v0: Tensor,
    prev_k: list[Tensor],
    prev_v: list[Tensor],
    lo: Tensor,
    hi: Tensor,
    scale: float,
    impl: AttentionImpl = "dense",
) -> Tensor:
    """One TTT step. q [Bt, T, nh, hd]; k0/v0 [Bt, T, nkv, hd] step-0 keys; prev_k/prev_v keys
    of steps 1..k (empty at step 0, the current step's own key included otherwise);
    lo/hi [Bt, T] the causal document range (doc_start, i + 1). Returns [Bt, T, nh, hd]."""
    if impl == "dense":
        return ttt_attention_chunked(q, k0, v0, prev_k, prev_v, lo, hi, scale)
    return ttt_attention_merged(q, k0, v0, prev_k, prev_v, lo, hi, scale, impl)


def ttt_attention_chunked(
    q: Tensor,
    k0: Tensor,
    v0: Tensor,
    prev_k: list[Tensor],
    prev_v: list[Tensor],
    lo: Tensor,
    hi: Tensor,
    scale: float,
    max_chunk_queries: int = 128,
) -> Tensor:
    """The CPU path: fused flash-attention calls per chunk of queries over its causal window
    of step-0 keys (:func:`~draftflow.models.window_attention.grouped_window_attention`, one
    group per index holding its k earlier-step keys): a chunk of n queries scores the window
    from the smallest document start to its last index (no [T, T] tensor), each index's
    queries its own k earlier-step keys by batched matmuls, merged by log-sum-exp. Every
    query sees itself."""
    bt, t, nh, hd = q.shape
    nkv, steps = k0.shape[2], len(prev_k)
    kd = torch.stack(prev_k, 2).reshape(bt, t * steps, nkv, hd) if steps else None  # index-major
    vd = torch.stack(prev_v, 2).reshape(bt, t * steps, nkv, hd) if steps else None
    return grouped_window_attention(q, k0, v0, lo, hi, kd, vd, 1, steps, scale, max_chunk_queries)


def ttt_attention_merged(
    q: Tensor,
    k0: Tensor,
    v0: Tensor,
    prev_k: list[Tensor],
    prev_v: list[Tensor],
    lo: Tensor,
    hi: Tensor,
    scale: float,
    impl: AttentionImpl = "dense",
) -> Tensor:
    """Range attention over step-0 keys and the per-index previous-step keys, merged by
    log-sum-exp (the flex path, and the reference the chunked SDPA path is tested against)."""
    out, lse = range_attention(q, k0, v0, lo, hi, scale, impl)
    if not prev_k:
        return out
    out_d, lse_d = diagonal_attention(q, prev_k, prev_v, scale)
    return merge_attention(out, lse, out_d, lse_d)
