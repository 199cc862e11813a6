"""Eagle3: an autoregressive one-layer drafter fed with fused target hidden states.

What it computes (the same as vLLM 0.32's ``Eagle3LlamaForCausalLM`` + the EAGLE proposer):

1. ``g = fc(concat(h_l1, ..., h_ln))``, [T, n·H] → [T, H] (ascending layer ids, no bias).
2. One Llama decoder layer with a 2H-wide attention input:
       e = input_layernorm(embed(token))
       norm_before_residual:  h' = hidden_norm(h); residual = h'
       otherwise:             h' = hidden_norm(h); residual = h
       x = residual + o_proj(attn([e ; h']))        q/k/v_proj: 2H → heads, RoPE, no q/k norm
       out = x + mlp(post_attention_layernorm(x))   (``out`` is the pre-norm output)
3. ``norm(out)`` → ``lm_head`` over the draft vocabulary; target id = draft id + ``d2t``.
4. Chaining: the first pass pairs the target's state at position i with token i+1 (ids
   shifted left, the target's next token last); each further step feeds the previous
   step's pre-norm ``out`` and its drafted token at position + 1.

Training-time test (:meth:`Eagle3Drafter.forward_ttt`) unrolls ``steps`` of 4. in parallel
over all positions, step k reading token i+1+k and attending per ``attention.py``; the loss
of step k is weighted ``decay**k``. Trainable: fc and the layer, norm, lm_head (unless
frozen). Frozen: embed_tokens (the target's).

Activation checkpointing (``checkpoint_steps``, the recipe's ``drafter.activation_checkpointing``):
each TTT step's layer pass, and separately its head and loss, are recomputed in the backward
pass. What a step then keeps until backward is what later steps read: its output and its
key/value, (H + 2·kv) values per token instead of the layer's, the attention's and the
head's activations (the vocabulary-wide logits among them).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from draftflow.models.common import PackedBatch, RMSNorm, RotaryEmbedding, SwiGLU, attention_scale, shift_left
from draftflow.models.eagle3.attention import ttt_attention
from draftflow.models.eagle3.config import Eagle3Config
from draftflow.models.losses import (
    LossKind,
    LossOutput,
    draft_metrics,
    head_soft_cross_entropy,
    target_probs,
    token_cross_entropy,
    ttt_weight,
    weighted_mean,
)
from draftflow.models.vocab import DraftVocab


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        pos: Tensor,
        cache: dict,
        lo: Tensor,
        hi: Tensor,
        rope: RotaryEmbedding,
        impl: str,
        rows: Tensor | None = None,
    ) -> Tensor:
        # x [Bt, T, 2H]; cache holds step-0 keys "k0"/"v0" and later steps' "k"/"v" lists.
        # rows [R]: queries at those indices only (keys at every index); lo/hi are theirs.
        k = rope(self.k_proj(x).unflatten(-1, (self.nkv, self.hd)), pos)  # [Bt, T, nkv, hd]
        v = self.v_proj(x).unflatten(-1, (self.nkv, self.hd))
        if rows is not None:
            x, pos = x[:, rows], pos[:, rows]
        q = rope(self.q_proj(x).unflatten(-1, (self.nh, self.hd)), pos)  # [Bt, R, nh, hd]
        if "k0" not in cache:
            cache.update(k0=k, v0=v, k=[], v=[])
        else:
            cache["k"].append(k)
            cache["v"].append(v)
        out = ttt_attention(
            q, cache["k0"], cache["v0"], cache["k"], cache["v"], lo, hi, attention_scale(self.hd), impl
        )
        return self.o_proj(out.flatten(-2))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds, hidden, pos, cache, lo, hi, rope, impl, rows=None) -> Tensor:
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        if rows is not None:
            residual = residual[:, rows]
        x = residual + self.self_attn(torch.cat([e, h], -1), pos, cache, lo, hi, rope, impl, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    def __init__(self, config: Eagle3Config, vocab: DraftVocab | None = None):
        super().__init__()
        self.config = cfg = config
        vocab = vocab or DraftVocab.identity(cfg.vocab_size)
        if (vocab.draft_vocab_size, vocab.target_vocab_size) != (cfg.draft_vocab_size, cfg.vocab_size):
            raise ValueError("draft vocab does not match the config's (draft_)vocab_size")
        self.attn_impl = "auto"  # "dense" | "flex" | "auto" (flex on accelerators)
        self.checkpoint_steps = False  # recompute each TTT step in backward (module docstring)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        self.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t, self.t2d)

    @classmethod
    def from_target(
        cls,
        target: str | Path,
        *,
        num_aux_layers: int,
        vocab: DraftVocab | None = None,
        norm_before_residual: bool = True,
        freeze_lm_head: bool = False,
    ) -> Eagle3Drafter:
        """A fresh drafter; embedding and the initial lm_head come from the target's safetensors."""
        from draftflow.models.target_weights import load_embeddings, load_lm_head, read_config

        cfg = Eagle3Config.from_target(
            read_config(target),
            num_aux_layers=num_aux_layers,
            draft_vocab_size=vocab.draft_vocab_size if vocab else None,
            norm_before_residual=norm_before_residual,
            freeze_lm_head=freeze_lm_head,
        )
        model = cls(cfg, vocab)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(load_embeddings(target))
            model.lm_head.weight.copy_(load_lm_head(target)[model.vocab.target_ids()])
        return model

    def _impl(self, device: torch.device) -> str:
        return ("flex" if device.type != "cpu" else "dense") if self.attn_impl == "auto" else self.attn_impl

    def combine_hidden_states(self, aux_hidden: Tensor) -> Tensor:
        """[Bt, T, n, H] → [Bt, T, H]."""
        return self.fc(aux_hidden.flatten(-2).to(self.fc.weight.dtype))

    def step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        pos: Tensor,
        cache: dict,
        lo: Tensor,
        hi: Tensor,
        rows: Tensor | None = None,
    ) -> Tensor:
        """One drafter pass: tokens [Bt, T], hidden [Bt, T, H] → pre-norm output [Bt, T, H]
        (with ``rows`` [R]: keys at every index, output [Bt, R, H] at those; lo/hi [Bt, R])."""
        return self.layers[0](
            self.embed_tokens(tokens),
            hidden,
            pos,
            cache,
            lo,
            hi,
            self.rotary,
            self._impl(hidden.device),
            rows,
        )

    def compute_logits(self, hidden_prenorm: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden_prenorm))  # [..., draft_vocab]

    def forward_ttt(
        self,
        input_ids: Tensor,
        aux_hidden: Tensor,
        position_ids: Tensor,
        doc_start: Tensor,
        steps: int,
        rows: Tensor | None = None,
    ) -> list[Tensor]:
        """Unrolled training-time test; returns the pre-norm output [Bt, T, H] of every step.

        Step k at index i reads token i+1+k (teacher forcing: the token vLLM feeds when every
        earlier draft was accepted), position pos[i]+k, and the previous step's output.
        ``rows`` [R] (sorted indices): outputs [Bt, R, H] at those indices only, the same
        values. Index i's chain (its steps' outputs and step >= 1 keys) is read by index i
        alone, so indices whose chain feeds no loss (prompt tokens) need only their step-0
        keys, which every later index attends to.
        """
        t = input_ids.shape[1]
        hi = torch.arange(1, t + 1, device=input_ids.device).expand_as(doc_start)
        lo = doc_start
        if rows is not None:
            lo, hi = lo[:, rows], hi[:, rows]
        hidden, cache, outs = self.combine_hidden_states(aux_hidden), {}, []
        recompute = self.checkpoint_steps and torch.is_grad_enabled()
        for k in range(steps):
            tokens, pos = shift_left(input_ids, 1 + k), position_ids + k
            if rows is not None and k > 0:  # the chain from step 1 on lives on `rows` only
                tokens, pos = tokens[:, rows], pos[:, rows]
            step_rows = rows if k == 0 else None
            if recompute:
                hidden = self._recomputed_step(tokens, hidden, pos, cache, lo, hi, step_rows)
            else:
                hidden = self.step(tokens, hidden, pos, cache, lo, hi, step_rows)
            outs.append(hidden)
        return outs

    def _recomputed_step(self, tokens, hidden, pos, cache, lo, hi, rows) -> Tensor:
        """:meth:`step` under activation checkpointing. The step's inputs, earlier steps' keys
        included, are explicit tensors so that backward can replay it; its own key/value come
        out as outputs and are added to ``cache`` here, not inside the replayed function."""
        earlier = (cache["k0"], cache["v0"], *cache["k"], *cache["v"]) if cache else ()
        out, key, value = checkpoint(
            self._step_from_tensors, tokens, hidden, pos, lo, hi, rows, *earlier, use_reentrant=False
        )
        if not cache:
            cache.update(k0=key, v0=value, k=[], v=[])
        else:
            cache["k"].append(key)
            cache["v"].append(value)
        return out

    def _step_from_tensors(
        self, tokens, hidden, pos, lo, hi, rows, *earlier
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(output, this step's key, value); ``earlier`` = (k0, v0, k1..kn, v1..vn) or empty at step 0."""
        n = (len(earlier) - 2) // 2
        cache = {}
        if earlier:
            cache = {
                "k0": earlier[0],
                "v0": earlier[1],
                "k": list(earlier[2 : 2 + n]),
                "v": list(earlier[2 + n :]),
            }
        out = self.step(tokens, hidden, pos, cache, lo, hi, rows)
        if not earlier:
            return out, cache["k0"], cache["v0"]
        return out, cache["k"][-1], cache["v"][-1]

    @torch.no_grad()
    def propose(
        self,
        aux_hidden: Tensor,
        input_ids: Tensor,
        next_tokens: Tensor,
        num_tokens: int,
        position_ids: Tensor | None = None,
        return_logits: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Draft a chain as vLLM does. aux_hidden [Bt, T, n, H] and input_ids [Bt, T] are the
        tokens the target processed; next_tokens [Bt] its next token. Returns [Bt, K] target
        ids (and the draft-vocab logits [Bt, K, Vd] with ``return_logits``)."""
        bt, t = input_ids.shape
        device = input_ids.device
        pos = position_ids if position_ids is not None else torch.arange(t, device=device).expand(bt, t)
        lo = torch.zeros_like(pos)
        hi = torch.arange(1, t + 1, device=device).expand(bt, t)
        tokens = torch.cat([input_ids[:, 1:], next_tokens[:, None]], 1)
        hidden, cache, drafts, logits = self.combine_hidden_states(aux_hidden), {}, [], []
        for k in range(num_tokens):
            hidden = self.step(tokens, hidden, pos + k, cache, lo, hi)
            logits.append(self.compute_logits(hidden[:, -1]))  # [Bt, Vd]
            drafts.append(self.vocab.to_target(logits[-1].argmax(-1)))
            tokens = drafts[-1][:, None].expand(bt, t)  # only the last index matters from here on
        drafts = torch.stack(drafts, 1)
        return (drafts, torch.stack(logits, 1)) if return_logits else drafts

    @torch.no_grad()
    def drafts_at_anchors(
        self, aux_hidden: Tensor, token_ids: Tensor, anchors: Tensor, num_tokens: int
    ) -> Tensor:
        """What :meth:`propose` drafts (``num_tokens`` long) for the prefix
        x[0..a-1] and bonus x[a], at every anchor a of one sequence at once (teacher-forced
        validation). Each chain step feeds its index's own previous draft and attends causally to
        step 0 plus its own earlier steps (vLLM's KV cache). aux_hidden [T, n, H], token_ids [T],
        anchors [A] → target ids [A, K]."""
        t = token_ids.shape[0]
        pos = torch.arange(t, device=token_ids.device)[None]
        lo, hi = torch.zeros_like(pos), pos + 1
        tokens = shift_left(token_ids[None], 1)
        state, cache, drafts = self.combine_hidden_states(aux_hidden[None]), {}, []
        for k in range(num_tokens):
            state = self.step(tokens, state, pos + k, cache, lo, hi)
            drafts.append(self.vocab.to_target(self.compute_logits(state[0]).argmax(-1)))
            tokens = drafts[-1][None]
        return torch.stack(drafts, 1)[anchors - 1]


def step_targets(input_ids: Tensor, loss_mask: Tensor, doc_end: Tensor, step: int) -> tuple[Tensor, Tensor]:
    """TTT step k at index i predicts the data token i+2+k (index i holds the target's state
    of token i, its input token is i+1+k). Returns labels [Bt, T] (target ids) and labelled
    [Bt, T] (that token lies in i's document and counts for the loss)."""
    idx = torch.arange(input_ids.shape[1], device=input_ids.device)
    labelled = shift_left(loss_mask.bool(), 2 + step, False) & (idx + 2 + step < doc_end)
    return shift_left(input_ids, 2 + step), labelled


def _token_loss(model: Eagle3Drafter, out: Tensor, picked: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(mean CE of the rows ``out[picked]`` to ``labels`` (draft ids, -1 = OOV), their argmax)."""
    logits = model.compute_logits(out[picked])  # [M, Vd]
    return weighted_mean(token_cross_entropy(logits, labels), (labels >= 0).float()), logits.argmax(-1)


def _target_loss(
    model: Eagle3Drafter, out: Tensor, picked: Tensor, probs: Tensor, index: Tensor
) -> tuple[Tensor, Tensor]:
    """(mean soft CE of the rows ``out[picked]`` to the target's ``probs[index]``, their argmax)."""
    weights = torch.ones(index.shape[0], dtype=torch.float32, device=index.device)
    return head_soft_cross_entropy(model.norm(out[picked]), model.lm_head, probs, index, weights)


def eagle3_loss(
    model: Eagle3Drafter,
    batch: PackedBatch,
    *,
    steps: int,
    decay: float,
    loss: LossKind = "tokens",
    target_head: nn.Module | None = None,
) -> LossOutput:
    """Sum over TTT steps of decay**k × mean CE (or soft CE to the target) of step k."""
    doc_start, doc_end, pos = batch.documents()
    mask = batch.loss_mask.bool()
    total = torch.zeros((), device=pos.device)
    steps_ok = [step_targets(batch.input_ids, mask, doc_end, k) for k in range(steps)]
    # Indices labelled at some step (in any row): only their chains feed the loss; the
    # others (prompt tokens, document ends) contribute their step-0 keys alone.
    chain = torch.stack([ok for _, ok in steps_ok]).any(0).any(0).nonzero()[:, 0] if steps else None
    if chain is not None and chain.numel() in (0, mask.shape[1]):
        chain = None
    outs = model.forward_ttt(batch.input_ids, batch.hidden_states, pos, doc_start, steps, chain)
    if loss == "target_logits":
        if target_head is None or batch.last_hidden is None:
            raise ValueError("loss='target_logits' needs target_head and batch.last_hidden")
        # The target's distribution once per position for all steps: step k at index i reads
        # position i+1+k (past the end only for unlabelled indices, which read the last row).
        t = pos.shape[1]
        idx = torch.arange(t, device=pos.device).expand_as(pos)
        needed = torch.zeros_like(mask)
        for k, (_, ok) in enumerate(steps_ok):
            needed[:, 1 + k :] |= ok[:, : max(0, t - 1 - k)]
        probs, rows = target_probs(target_head, batch.last_hidden, idx, needed)
    if loss not in ("tokens", "target_logits"):
        raise ValueError(f"unknown loss {loss!r}")
    recompute = model.checkpoint_steps and torch.is_grad_enabled()
    preds, labels, labelled = [], [], []
    for k, (out, (lab, ok)) in enumerate(zip(outs, steps_ok)):
        lab = model.vocab.to_draft(lab)
        # the rows of `out` with a label (the rest weigh 0); every labelled index is in `chain`
        picked = ok if chain is None else ok[:, chain]
        if loss == "tokens":
            head_loss, args = _token_loss, (lab[ok],)
        else:
            at = torch.cat([rows[:, 1 + k :], rows[:, -1:].expand(-1, min(1 + k, rows.shape[1]))], 1)
            head_loss, args = _target_loss, (probs, at[:, : rows.shape[1]][ok])
        if recompute:  # the [M, vocabulary] logits are not kept for backward either
            value, argmax = checkpoint(head_loss, model, out, picked, *args, use_reentrant=False)
        else:
            value, argmax = head_loss(model, out, picked, *args)
        total = total + ttt_weight(decay, k) * value
        pred = torch.full_like(lab, -1)
        pred[ok] = argmax  # unlabelled indices never count as hits
        preds.append(pred)
        labels.append(lab)
        labelled.append(ok)
    # A draft starts at every index whose bonus token (i+1) is a response token and whose
    # first draft position has a label.
    draft_valid = (shift_left(mask, 1, False) & labelled[0]).reshape(-1)
    metrics = draft_metrics(
        torch.stack(preds, -1).reshape(-1, steps),
        torch.stack(labels, -1).reshape(-1, steps),
        torch.stack(labelled, -1).reshape(-1, steps),
        draft_valid,
    )
    return LossOutput(total, metrics)
