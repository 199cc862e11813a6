"""Building blocks shared by the drafters (plain PyTorch, numerics matched to vLLM 0.32).

- :class:`RMSNorm`: ``x * rsqrt(mean(x²) + eps) * w`` in fp32, cast back (vLLM's ``rms_norm``).
- :class:`RotaryEmbedding`: default RoPE, neox layout (rotate halves), ``inv_freq =
  theta^(-2i/d)`` computed in fp32 like vLLM's cos/sin cache.
- :class:`SwiGLU`: ``down(silu(gate(x)) * up(x))`` with the HF/vLLM weight names.
- Range attention: each query sees one contiguous key range ``[lo, hi)``. With packed,
  contiguous documents both drafters' "long" masks are ranges (DFlash: the context of the
  anchor's document before the anchor; Eagle3: the causal prefix of the document). It
  returns the log-sum-exp so a second, small attention part can be merged exactly
  (:func:`merge_attention`). Two implementations: ``"dense"`` (chunked over queries,
  windowed over keys, recomputed in backward, so memory never holds a full score matrix)
  and ``"flex"`` (``torch.nn.attention.flex_attention`` with a block mask; compiled on
  GPU; on CPU forward-only since PyTorch has no CPU backward for it).
- :class:`PackedBatch` and document helpers for packed training sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

AttentionImpl = Literal["dense", "flex"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.to(self.weight.dtype) * self.weight).to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE in the neox layout; ``forward(x [..., heads, hd], pos [...])``."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        freqs = positions.float()[..., None] * self.inv_freq  # [..., hd/2]
        cos, sin = freqs.cos()[..., None, :], freqs.sin()[..., None, :]  # [..., 1, hd/2]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def frozen_linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    layer.weight.requires_grad_(False)
    return layer


# ----------------------------------------------------------------------------- attention


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Exact softmax over the union of two disjoint key sets, from each part's output and LSE.

    out_*: [..., heads, hd]; lse_*: [..., heads] (natural log, fp32, -inf = no keys).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse)[..., None]
    w_b = torch.exp(lse_b - lse)[..., None]
    return (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype)


def dense_attention_lse(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Softmax attention with an explicit boolean mask; GQA by head grouping.

    q: [Bt, Q, nh, hd]; k, v: [Bt, K, nkv, hd]; visible: broadcastable to [Bt, Q, K].
    Returns out [Bt, Q, nh, hd] and lse [Bt, Q, nh] (fp32). Rows with no visible key give
    out = 0, lse = -inf, and finite gradients.
    """
    bt, nq, nh, hd = q.shape
    nkv = k.shape[2]
    qg = q.float().view(bt, nq, nkv, nh // nkv, hd)
    s = torch.einsum("bqngd,bknd->bngqk", qg, k.float()) * scale  # [Bt, nkv, g, Q, K]
    vis = visible[:, None, None]  # [Bt, 1, 1, Q, K]
    s = s.masked_fill(~vis, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    p = e / total
    lse = torch.where(empty, torch.full_like(total, float("-inf")), torch.log(total) + m)[..., 0]
    out = torch.einsum("bngqk,bknd->bqngd", p, v.float()).reshape(bt, nq, nh, hd)
    lse = lse.permute(0, 3, 1, 2).reshape(bt, nq, nh)  # [Bt, Q, nh]
    return out.to(q.dtype), lse


def _range_chunk(
    q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    idx = torch.arange(k.shape[1], device=k.device)
    visible = (idx >= lo[..., None]) & (idx < hi[..., None])  # [Bt, Qc, W]
    return dense_attention_lse(q, k, v, visible, scale)


def range_attention_dense(
    q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float, max_chunk_elems: int = 1 << 24
) -> tuple[Tensor, Tensor]:
    """Range attention, chunked over queries and windowed over keys.

    Per chunk only the keys in [min lo, max hi) are scored; a chunk's scores are
    [Bt, nh, chunk, window] and are recomputed in backward (activation checkpointing), so
    peak memory is bounded by ``max_chunk_elems`` floats whatever the number of queries.
    """
    bt, nq, nh, hd = q.shape
    t = k.shape[1]
    chunk = max(1, min(nq, max_chunk_elems // max(1, bt * nh * t)))
    outs, lses = [], []
    for start in range(0, nq, chunk):
        sl = slice(start, start + chunk)
        qc, loc, hic = q[:, sl], lo[:, sl], hi[:, sl]
        k0 = int(loc.min().clamp(0, t))
        k1 = int(hic.max().clamp(0, t))
        if k1 <= k0:  # no query of this chunk sees any key
            outs.append(torch.zeros_like(qc))
            lses.append(torch.full(qc.shape[:3], float("-inf"), device=q.device))
            continue
        args = (qc, k[:, k0:k1], v[:, k0:k1], loc - k0, hic - k0, scale)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            o, lse = checkpoint(_range_chunk, *args, use_reentrant=False)
        else:
            o, lse = _range_chunk(*args)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 1)


_compiled_flex = None


def flex_attention_fn(device: torch.device):
    """``flex_attention``, compiled on accelerators (eager on CPU: unfused but exact)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cpu":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def range_attention_flex(
    q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Range attention through flex_attention with a block mask (same contract as dense)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    bt, nq, nh, hd = q.shape
    nk = k.shape[1]

    def mask_mod(b, h, qi, ki):
        return (ki >= lo[b, qi]) & (ki < hi[b, qi])

    mask = create_block_mask(mask_mod, bt, None, nq, nk, device=q.device, _compile=q.device.type != "cpu")
    out, aux = flex_attention_fn(q.device)(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=mask,
        scale=scale,
        enable_gqa=nh != k.shape[2],
        return_aux=AuxRequest(lse=True),
    )
    empty = (hi <= lo)[..., None]  # flex leaves fully masked rows to the kernel; pin them down
    out = out.transpose(1, 2).masked_fill(empty[..., None], 0.0)
    lse = aux.lse.transpose(1, 2).float().masked_fill(empty, float("-inf"))
    return out, lse


def range_attention(
    q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float, impl: AttentionImpl = "dense"
) -> tuple[Tensor, Tensor]:
    """q [Bt, Q, nh, hd] attends to k/v [Bt, K, nkv, hd] at indices lo[b,q] <= i < hi[b,q]."""
    if impl == "flex":
        return range_attention_flex(q, k, v, lo, hi, scale)
    return range_attention_dense(q, k, v, lo, hi, scale)


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ----------------------------------------------------------------------------- packed data


@dataclass
class PackedBatch:
    """Packed training sequences (documents laid end to end in each row).

    input_ids: [Bt, T] token ids.
    hidden_states: [Bt, T, n, H] the drafter's context layers, in ascending layer-id order
        (the order vLLM concatenates them in).
    loss_mask: [Bt, T] 1 where a token counts for the loss (assistant tokens).
    doc_ids: [Bt, T] document id per token; documents must be contiguous runs. None = one
        document per row.
    position_ids: [Bt, T]; None = restart at 0 at each document start.
    last_hidden: [Bt, T, H] the target's last layer before its final norm (extraction id L),
        needed only for the ``target_logits`` loss.
    """

    input_ids: Tensor
    hidden_states: Tensor
    loss_mask: Tensor
    doc_ids: Tensor | None = None
    position_ids: Tensor | None = None
    last_hidden: Tensor | None = None

    def documents(self) -> tuple[Tensor, Tensor, Tensor]:
        """(doc_start, doc_end, position_ids), each [Bt, T] int64."""
        doc_ids = self.doc_ids if self.doc_ids is not None else torch.zeros_like(self.input_ids)
        start, end = document_bounds(doc_ids)
        pos = self.position_ids
        if pos is None:
            pos = torch.arange(doc_ids.shape[1], device=doc_ids.device) - start
        return start, end, pos.long()


def with_feature_noise(batch: PackedBatch, relative_std: float, generator: torch.Generator) -> PackedBatch:
    """The batch with Gaussian noise on the context states the drafter reads: each token's
    state in each layer gets noise of ``relative_std`` times its own RMS (layers differ in
    scale by orders of magnitude). The target's last layer, which the KL loss turns into the
    target's distribution, stays exact."""
    h = batch.hidden_states
    rms = h.float().pow(2).mean(-1, keepdim=True).sqrt_()
    noise = torch.randn(h.shape, generator=generator, device=h.device, dtype=torch.float32)
    return replace(batch, hidden_states=noise.mul_(rms.mul_(relative_std)).add_(h).to(h.dtype))


def with_every_position_labelled(batch: PackedBatch) -> PackedBatch:
    """The batch with every token counting for the loss, not only the assistant's. Packs hold
    whole documents end to end with no padding, so every position is a real token (with the
    target's distribution for the target-logits loss); the losses' document bounds still keep
    each label inside its own document."""
    return replace(batch, loss_mask=torch.ones_like(batch.loss_mask))


def document_bounds(doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each token, the index of its document's first token and one past its last.

    doc_ids: [Bt, T]; a document is a maximal run of equal ids. Raises if an id occurs in
    two separate runs (the documents of a packed row must be contiguous).
    """
    bt, t = doc_ids.shape
    idx = torch.arange(t, device=doc_ids.device).expand(bt, t)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    runs = int(new.sum())
    uniques = sum(int(torch.unique(row).numel()) for row in doc_ids)
    if runs != uniques:
        raise ValueError("doc_ids: every document must be one contiguous run of tokens")
    start = torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), dim=1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    end_rev = torch.where(last, idx + 1, torch.full_like(idx, t)).flip(1)
    end = torch.cummin(end_rev, dim=1).values.flip(1)
    return start, end


def shift_left(x: Tensor, n: int, fill: int | float = 0) -> Tensor:
    """x[:, i + n] at index i along dim 1, ``fill`` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)
