"""Losses and acceptance metrics shared by the drafters.

Conventions (both drafters):
- A *draft position* k = 1..K is the k-th token a drafter proposes after the last accepted
  token (DFlash: block slot k; Eagle3: TTT step k-1).
- Labels are data tokens mapped to the draft vocab. A label outside the draft vocab is
  **ignored by the cross-entropy** (no class to push towards) but **counted as wrong** by
  the accuracy: the drafter can never propose it, so vLLM would reject that draft.
- ``loss="target_logits"``: soft cross-entropy ``-sum_v p_target(v) log q(v)`` to the target's
  distribution restricted to the draft vocab and renormalised (= KL(p||q) + H(p), same
  gradient as KL). Accuracy is still measured against the data tokens, which for
  regenerated (greedy) responses are the target's own choices.
- Acceptance length (tokens per target forward, bonus token included):
  ``acceptance_length`` = 1 + sum_k prod_{j<=k} acc_j, which treats positions as
  independent; ``prefix_acceptance_length`` = 1 + mean over drafts of the number of leading
  correct positions (a run stops at the first wrong or unlabelled position), the exact
  teacher-forced value for the sampled drafts. Both count OOV labels as wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

LossKind = Literal["tokens", "target_logits"]


def dflash_position_weights(block_size: int, gamma: float) -> Tensor:
    """[B] w_0 = 0 (the anchor slot), w_k = exp(-(k-1)/gamma) for k = 1..B-1."""
    k = torch.arange(block_size, dtype=torch.float)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def token_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-item CE [...] to draft-vocab labels; 0 where label < 0 (OOV or unlabelled)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    ce = F.cross_entropy(flat, labels.reshape(-1).clamp_min(0), reduction="none")
    return ce.view(labels.shape) * (labels >= 0)


def soft_cross_entropy(logits: Tensor, target_logits: Tensor) -> Tensor:
    """Per-item ``-sum p_target log_softmax(logits)`` [...]."""
    p = torch.softmax(target_logits.float(), dim=-1)
    return -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


class _GatheredSoftCrossEntropy(torch.autograd.Function):
    """``-sum_v p[index[n], v] log_softmax(logits[n])_v`` per row n, p rows shared by index.

    Written as ``logsumexp(logits[n]) - p[index[n]] · logits[n]`` (p sums to 1), gradient
    ``softmax(logits[n]) - p[index[n]]``. Processed in row chunks through one reused buffer,
    so neither the gathered target distribution nor a log-softmax of the logits ever exists
    in full: the only [rows, vocab] tensors are the logits (saved) and their gradient.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, probs: Tensor, index: Tensor, chunk: int) -> Tensor:
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        out = torch.empty_like(lse)
        buf = probs.new_empty(min(chunk, n), probs.shape[1])
        for s in range(0, n, chunk):
            x = logits[s : s + chunk].float()
            p = torch.index_select(probs, 0, index[s : s + chunk], out=buf[: x.shape[0]])
            lse[s : s + chunk] = torch.logsumexp(x, -1)
            out[s : s + chunk] = lse[s : s + chunk] - torch.linalg.vecdot(x, p)
        ctx.save_for_backward(logits, probs, index, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, probs, index, lse = ctx.saved_tensors
        grad = torch.empty_like(logits, dtype=torch.float32)
        buf = probs.new_empty(min(ctx.chunk, logits.shape[0]), probs.shape[1])
        for s in range(0, logits.shape[0], ctx.chunk):
            e = s + ctx.chunk
            g = grad[s:e]
            torch.sub(logits[s:e].float(), lse[s:e, None], out=g)
            g.exp_().sub_(torch.index_select(probs, 0, index[s:e], out=buf[: g.shape[0]]))
            g.mul_(grad_out[s:e, None])
        return grad.to(logits.dtype), None, None, None


def soft_cross_entropy_gathered(
    logits: Tensor, target_probs: Tensor, index: Tensor, chunk_rows: int = 512
) -> Tensor:
    """Per-item soft CE [...] of ``logits`` [..., V] to the rows ``target_probs[index]``.

    target_probs: [U, V] distributions (no gradient), shared by items with the same index
    [...] (several blocks predicting the same token position). Equals
    ``soft_cross_entropy(logits, target_logits[index])`` with ``target_probs`` the softmax
    of ``target_logits``, in less time and memory.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = _GatheredSoftCrossEntropy.apply(flat, target_probs.float().detach(), index.reshape(-1), chunk_rows)
    return out.view(index.shape)


class _HeadSoftCrossEntropy(torch.autograd.Function):
    """``sum_n r[n] · (-sum_v p[index[n], v] log_softmax(hidden[n] @ weight.T)_v)`` and the
    argmax of each row's logits, the head fused into the loss.

    Per chunk of rows: logits into one reused buffer, their log-sum-exp, the dot with the
    target rows, then at once the gradient ``r[n] · (softmax - p)`` in the same buffer and its
    product with the head (and the head's own gradient when it trains). Backward only scales
    those by the incoming scalar gradient. No [rows, vocab] tensor outlives its chunk: neither
    logits nor their gradient is kept for backward, and each chunk's buffer stays hot in cache
    between the matmul and the softmax passes (fp32, no autocast: see :func:`head_soft_cross_entropy`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, probs, index, row_weights, chunk):
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        pred = torch.empty(n, dtype=torch.long, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows = min(chunk, n)
        buf = hidden.new_empty(rows, weight.shape[0])
        pbuf = probs.new_empty(rows, probs.shape[1])
        for s in range(0, n, chunk):
            x = hidden[s : s + chunk]
            m = x.shape[0]
            z = torch.mm(x, weight.t(), out=buf[:m])
            top, pred[s : s + m] = z.max(-1)  # the row max and the argmax in one pass
            p = torch.index_select(probs, 0, index[s : s + m], out=pbuf[:m])
            r = row_weights[s : s + m]
            dot = torch.linalg.vecdot(z, p)
            # one exp pass, in place: e = exp(z - max), lse = max + log(sum e),
            # then r · (softmax - p) = (r / sum e) · e - r · p
            e = z.sub_(top[:, None]).exp_()
            total_e = e.sum(-1)
            total += ((top + total_e.log() - dot) * r).sum()
            e.mul_((r / total_e)[:, None]).sub_(p.mul_(r[:, None]))
            torch.mm(z, weight, out=grad_hidden[s : s + m])
            if grad_weight is not None:
                grad_weight.addmm_(z.t(), x)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(pred)
        return total, pred

    @staticmethod
    def backward(ctx, grad_total, _grad_pred):
        grad_hidden, grad_weight = ctx.saved_tensors
        gw = grad_weight * grad_total if grad_weight is not None else None
        return grad_hidden * grad_total, gw, None, None, None, None


def head_soft_cross_entropy(
    hidden: Tensor,
    head: torch.nn.Linear,
    target_probs: Tensor,
    index: Tensor,
    weights: Tensor,
    chunk_rows: int = 512,
) -> tuple[Tensor, Tensor]:
    """(weighted mean over rows of the soft CE of ``head(hidden)`` [N, V] to the rows
    ``target_probs[index]``, argmax of each row's logits [N]).

    The same values and gradients as ``weighted_mean(soft_cross_entropy_gathered(head(hidden),
    target_probs, index), weights)`` and ``head(hidden).argmax(-1)``. fp32 without autocast
    (the CPU trainer) runs the head fused into the loss (:class:`_HeadSoftCrossEntropy`) in
    chunks of ``chunk_rows``; anything else takes that unfused formula.

    512-row chunks rather than 256: a matmul of more rows runs at a higher rate, and a small
    batch then fits one chunk; the cost is a little more peak memory (bench/train.py)."""
    fused = (
        hidden.dtype == head.weight.dtype == target_probs.dtype == torch.float32
        and head.bias is None
        and not torch.is_autocast_enabled(hidden.device.type)
    )
    if not fused:
        logits = head(hidden)
        per_item = soft_cross_entropy_gathered(logits, target_probs, index)
        return weighted_mean(per_item, weights), logits.argmax(-1)
    total = weights.sum()
    scale = weights / total if total > 0 else torch.zeros_like(weights)
    loss, pred = _HeadSoftCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        target_probs.detach(),
        index.reshape(-1),
        scale.reshape(-1).float(),
        chunk_rows,
    )
    return loss, pred.view(index.shape)


def target_probs(
    target_head, last_hidden: Tensor, index: Tensor, keep: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The target's distributions at positions ``index`` [Bt, N] of ``last_hidden`` [Bt, T, H]:
    (probs [U, V], rows [Bt, N]) for :func:`soft_cross_entropy_gathered`. Items outside
    ``keep`` [Bt, N] (default: all) need not be computed; their rows point anywhere.

    A :class:`~draftflow.models.target_weights.TargetHead` computes each distinct position
    once (``probs_at``); any other head module is applied to every gathered item."""
    if hasattr(target_head, "probs_at"):
        return target_head.probs_at(last_hidden, index, keep)
    with torch.no_grad():
        gathered = last_hidden.gather(1, index[..., None].expand(-1, -1, last_hidden.shape[-1]))
        probs = torch.softmax(target_head(gathered).float(), dim=-1)
    rows = torch.arange(index.numel(), device=index.device).view(index.shape)
    return probs.reshape(index.numel(), -1), rows


@dataclass
class DraftMetrics:
    """Sums over the drafts of one batch (add them across ranks before dividing).

    correct, counts: [K] per draft position, labelled positions and correct ones among them.
    prefix_sum: total leading-correct run length; num_drafts: drafts counted.
    """

    correct: Tensor
    counts: Tensor
    prefix_sum: Tensor
    num_drafts: Tensor

    @property
    def accuracy(self) -> Tensor:
        return self.correct.float() / self.counts.clamp_min(1).float()

    @property
    def acceptance_length(self) -> float:
        return 1.0 + float(torch.cumprod(self.accuracy, 0).sum())

    @property
    def prefix_acceptance_length(self) -> float:
        return 1.0 + float(self.prefix_sum) / max(1, int(self.num_drafts))

    def as_dict(self) -> dict[str, float]:
        out = {f"acc_{k + 1}": float(a) for k, a in enumerate(self.accuracy)}
        out["acceptance_length"] = self.acceptance_length
        out["prefix_acceptance_length"] = self.prefix_acceptance_length
        return out


def draft_metrics(pred: Tensor, labels: Tensor, labelled: Tensor, draft_valid: Tensor) -> DraftMetrics:
    """pred/labels [N, K] draft ids (label -1 = OOV, counted wrong); labelled [N, K] bool
    (a data token exists and is loss-masked); draft_valid [N] bool (real draft, not padding)."""
    labelled = labelled & draft_valid[:, None]
    hit = (pred == labels) & (labels >= 0) & labelled
    run = torch.cumprod(hit.long(), dim=1).sum(1)
    return DraftMetrics(
        correct=hit.sum(0).detach(),
        counts=labelled.sum(0).detach(),
        prefix_sum=(run * draft_valid).sum().detach(),
        num_drafts=draft_valid.sum().detach(),
    )


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable
    metrics: DraftMetrics


def weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    total = weights.sum()
    return (values * weights).sum() / total.clamp_min(1e-12) if total > 0 else values.sum() * 0.0


def ttt_weight(decay: float, step: int) -> float:
    return math.pow(decay, step)
