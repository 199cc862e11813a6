"""DFlash: a block-diffusion drafter that drafts B-1 tokens in one forward pass.

What it computes (the same as vLLM 0.32's ``DFlashQwen3ForCausalLM`` + ``DFlashProposer``):

1. Fused target context: ``c = hidden_norm(fc(concat(h_l1, ..., h_ln)))``, [T, n·H] → [T, H],
   layers concatenated in ascending layer-id order, ``fc`` without bias.
2. Block input ``[anchor token, MASK × (B-1)]`` embedded with the frozen target embedding;
   slot j sits at position ``pos(anchor) + j``. Slot j >= 1 predicts the token at anchor + j.
3. ``num_layers`` Qwen3 decoder layers (pre-norm residual):
       x = x + o_proj(attn(input_layernorm(x)));  x = x + mlp(post_attention_layernorm(x))
   Block q/k: ``rope(q_norm(q_proj x))``, ``rope(k_norm(k_proj x))``, v = ``v_proj x``.
   Context k/v, per layer from the same ``c`` (no input_layernorm): ``rope(k_norm(k_proj c),
   pos_ctx)``, ``v_proj c``. Keys of a block = context of its document strictly before the
   anchor ∪ its own block (non-causal); see ``attention.py``.
4. ``norm`` → frozen ``lm_head`` over the draft vocabulary; target id = draft id + ``d2t``.

Trainable: fc, hidden_norm, the decoder layers, norm. Frozen: embed_tokens, lm_head (draft
rows of the target's head). Training samples up to ``max_anchors`` anchors per packed row
and trains all their blocks in one pass (:func:`dflash_loss`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from draftflow.models.common import (
    PackedBatch,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    attention_scale,
    frozen_linear,
)
from draftflow.models.dflash.attention import dflash_attention
from draftflow.models.dflash.config import DFlashConfig
from draftflow.models.losses import (
    LossKind,
    LossOutput,
    dflash_position_weights,
    draft_metrics,
    head_soft_cross_entropy,
    target_probs,
    token_cross_entropy,
    weighted_mean,
)
from draftflow.models.vocab import DraftVocab

_ANCHOR_CHUNK = 256  # blocks per forward pass in drafts_at_anchors (bounds the logits' memory)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def project_kv(self, x: Tensor, pos: Tensor, rope: RotaryEmbedding) -> tuple[Tensor, Tensor]:
        """x [..., H], pos [...] → k, v [..., nkv, hd] (k normed and rotated)."""
        k = rope(self.k_norm(self.k_proj(x).unflatten(-1, (self.nkv, self.hd))), pos)
        return k, self.v_proj(x).unflatten(-1, (self.nkv, self.hd))

    def forward(
        self,
        x: Tensor,
        pos: Tensor,
        ctx: Tensor,
        ctx_pos: Tensor,
        lo: Tensor,
        hi: Tensor,
        rope: RotaryEmbedding,
        impl: str,
        first_query: int = 0,
    ) -> Tensor:
        """x [Bt, A, B, H]; ctx [Bt, T, H] → [Bt, A, B - first_query, H]: every slot is a key,
        only slots first_query.. are queries."""
        k, v = self.project_kv(x, pos, rope)  # [Bt, A, B, nkv, hd]
        if first_query:
            # a contiguous copy: a strided slice that requires grad sends q_proj to a batched
            # matmul copying the weight per anchor
            x, pos = x[:, :, first_query:].contiguous(), pos[:, :, first_query:]
        q = rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.nh, self.hd))), pos)  # [Bt, A, Bq, nh, hd]
        ctx_k, ctx_v = self.project_kv(ctx, ctx_pos, rope)  # [Bt, T, nkv, hd]
        out = dflash_attention(q, k, v, ctx_k, ctx_v, lo, hi, attention_scale(self.hd), impl)
        return self.o_proj(out.flatten(-2))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, pos, ctx, ctx_pos, lo, hi, rope, impl, first_query: int = 0):
        """[Bt, A, B, H] → [Bt, A, B - first_query, H] (slots before first_query only as keys)."""
        attn = self.self_attn(self.input_layernorm(x), pos, ctx, ctx_pos, lo, hi, rope, impl, first_query)
        x = x[:, :, first_query:] + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig, vocab: DraftVocab | None = None):
        super().__init__()
        self.config = cfg = config
        vocab = vocab or DraftVocab.identity(cfg.vocab_size)
        if (vocab.draft_vocab_size, vocab.target_vocab_size) != (cfg.draft_vocab_size, cfg.vocab_size):
            raise ValueError("draft vocab does not match the config's (draft_)vocab_size")
        self.attn_impl = "auto"  # "dense" | "flex" | "auto" (flex on accelerators)
        # Recompute each layer in backward: keeps one [Bt, A, B, H] input per layer instead of
        # every activation (~17 GB per layer at Qwen3-8B sizes, 3,072 anchors × block 16).
        self.checkpoint_layers = False
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_context_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = frozen_linear(cfg.hidden_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight.requires_grad:
                nn.init.normal_(module.weight, std=0.02)

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t, self.t2d)

    @classmethod
    def from_target(
        cls,
        target: str | Path,
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        num_context_layers: int,
        vocab: DraftVocab | None = None,
        init_from_target: bool = False,
    ) -> DFlashDrafter:
        """A fresh drafter whose embedding and head are read from the target's safetensors
        (and its decoder layers too with ``init_from_target``: :meth:`copy_target_layers`)."""
        from draftflow.models.target_weights import load_embeddings, load_lm_head, read_config

        cfg = DFlashConfig.from_target(
            read_config(target),
            num_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            num_context_layers=num_context_layers,
            draft_vocab_size=vocab.draft_vocab_size if vocab else None,
        )
        model = cls(cfg, vocab)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(load_embeddings(target))
            model.lm_head.weight.copy_(load_lm_head(target)[model.vocab.target_ids()])
            if init_from_target:
                model.copy_target_layers(target)
        return model

    @torch.no_grad()
    def copy_target_layers(self, target: str | Path) -> list[str]:
        """Start the decoder layers from the target's last ones (drafter layer i of n ← target
        layer L - n + i): the same shapes, already turning hidden states into next-token
        features for the target's own head, which the drafter shares. Tensors the target has
        no counterpart for (q_norm / k_norm of a Llama target) keep their initial values.
        Returns the names copied."""
        from draftflow.models.target_weights import load_decoder_layer, read_config

        total = int(read_config(target)["num_hidden_layers"])
        copied = []
        for i, layer in enumerate(self.layers):
            own = layer.state_dict()
            found = load_decoder_layer(target, total - len(self.layers) + i, list(own))
            for name, tensor in found.items():
                own[name].copy_(tensor.to(own[name].dtype))
                copied.append(f"layers.{i}.{name}")
        return copied

    def _impl(self, device: torch.device) -> str:
        return ("flex" if device.type != "cpu" else "dense") if self.attn_impl == "auto" else self.attn_impl

    def fuse_context(self, hidden_states: Tensor) -> Tensor:
        """[Bt, T, n, H] target states → [Bt, T, H] fused context."""
        return self.hidden_norm(self.fc(hidden_states.flatten(-2).to(self.fc.weight.dtype)))

    def forward(
        self,
        block_ids: Tensor,
        block_pos: Tensor,
        context: Tensor,
        context_pos: Tensor,
        lo: Tensor,
        hi: Tensor,
        drafting_slots_only: bool = False,
    ) -> Tensor:
        """block_ids/block_pos [Bt, A, B]; context [Bt, T, H] (fused); context_pos [Bt, T];
        lo/hi [Bt, A] context range of each block. Returns normed hidden [Bt, A, B, H], or
        with ``drafting_slots_only`` that of slots 1..B-1 [Bt, A, B-1, H], the same values:
        the last layer then computes no query, MLP or norm for the anchor slot, whose output
        no head reads (it is still a key of its block)."""
        x = self.embed_tokens(block_ids)
        impl = self._impl(x.device)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            first = int(drafting_slots_only and i == len(self.layers) - 1)
            args = (x, block_pos, context, context_pos, lo, hi, self.rotary, impl, first)
            x = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)  # [..., draft_vocab]

    def make_blocks(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        doc_start: Tensor,
        anchors: Tensor,
        valid: Tensor,
        block_size: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Blocks at ``anchors`` [Bt, A] → block_ids, block_pos [Bt, A, B], lo, hi [Bt, A]
        (B = ``block_size``, default the trained one)."""
        b = block_size or self.config.block_size
        j = torch.arange(b, device=anchors.device)
        block_ids = torch.full(
            (*anchors.shape, b), self.config.mask_token_id, dtype=torch.long, device=anchors.device
        )
        block_ids[..., 0] = input_ids.gather(1, anchors)
        block_pos = position_ids.gather(1, anchors)[..., None] + j
        lo = doc_start.gather(1, anchors) * valid
        hi = anchors * valid  # context strictly before the anchor; padding anchors see none
        return block_ids, block_pos, lo, hi

    def served_block(self, num_tokens: int | None) -> int:
        """Slots of a block that drafts ``num_tokens`` (default B-1): vLLM builds the block from
        its draft length (anchor + k mask slots) and ignores the trained block size. Nothing in
        the weights depends on the block size, so any 1 <= k <= B-1 is served; a block shorter
        than trained sees fewer mask slots, so its drafts can differ a little from the first k
        of a full block's."""
        k = self.config.block_size - 1 if num_tokens is None else int(num_tokens)
        if not 1 <= k <= self.config.block_size - 1:
            raise ValueError(
                f"a DFlash drafter trained with blocks of {self.config.block_size} drafts 1 to "
                f"{self.config.block_size - 1} tokens, not {k}"
            )
        return k + 1

    @torch.no_grad()
    def propose(
        self,
        hidden_states: Tensor,
        anchor_tokens: Tensor,
        position_ids: Tensor | None = None,
        return_logits: bool = False,
        num_tokens: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Draft as vLLM does: context = every given state, anchor at ``last position + 1``.

        hidden_states [Bt, T, n, H] (tokens the target processed); anchor_tokens [Bt] (the
        target's next token). Returns greedy draft tokens [Bt, k] as target ids (and the
        draft-vocab logits [Bt, k, Vd] with ``return_logits``), k = ``num_tokens`` (default
        B-1; see :meth:`served_block`).
        """
        bt, t = hidden_states.shape[:2]
        device = hidden_states.device
        pos = position_ids if position_ids is not None else torch.arange(t, device=device).expand(bt, t)
        ctx = self.fuse_context(hidden_states)
        b = self.served_block(num_tokens)
        ids = torch.full((bt, 1, b), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0, 0] = anchor_tokens
        block_pos = pos[:, -1:, None] + 1 + torch.arange(b, device=device)  # [Bt, 1, B]
        lo = torch.zeros(bt, 1, dtype=torch.long, device=device)
        hidden = self(ids, block_pos, ctx, pos, lo, lo + t, drafting_slots_only=True)
        logits = self.compute_logits(hidden[:, 0])
        drafts = self.vocab.to_target(logits.argmax(-1))
        return (drafts, logits) if return_logits else drafts

    @torch.no_grad()
    def drafts_at_anchors(
        self, hidden_states: Tensor, token_ids: Tensor, anchors: Tensor, num_tokens: int
    ) -> Tensor:
        """What :meth:`propose` drafts for the prefix x[0..a-1] and bonus x[a], at every anchor a
        of one sequence at once (teacher-forced validation): hidden_states [T, n, H],
        token_ids [T], anchors [A] → target ids [A, num_tokens]."""
        b = self.served_block(num_tokens)
        t = token_ids.shape[0]
        pos = torch.arange(t, device=token_ids.device)[None]
        context = self.fuse_context(hidden_states[None])
        out = []
        for chunk in anchors.split(_ANCHOR_CHUNK):
            a = chunk[None]
            valid = torch.ones_like(a, dtype=torch.bool)
            block_ids, block_pos, lo, hi = self.make_blocks(
                token_ids[None], pos, torch.zeros_like(pos), a, valid, b
            )
            states = self(block_ids, block_pos, context, pos, lo, hi, drafting_slots_only=True)
            out.append(self.vocab.to_target(self.compute_logits(states[0]).argmax(-1)))
        if not out:
            return torch.zeros(0, b - 1, dtype=torch.long, device=token_ids.device)
        return torch.cat(out)


def sample_anchors(
    loss_mask: Tensor,
    doc_start: Tensor,
    doc_end: Tensor,
    block_size: int,
    max_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Up to ``max_anchors`` anchors per row, uniformly without replacement, sorted.

    An index ``a`` can anchor a block when the anchor token counts for the loss (it is a
    response token, as the bonus token is at inference), at least one context token of its
    document precedes it, and the whole block ``a .. a+B-1`` lies inside its document.
    Returns anchors [Bt, A] (int64) and valid [Bt, A] (bool; padding anchors are index 0).
    """
    bt, t = loss_mask.shape
    idx = torch.arange(t, device=loss_mask.device)
    ok = loss_mask.bool() & (idx > doc_start) & (idx + block_size <= doc_end)
    score = torch.rand(bt, t, generator=generator, device=loss_mask.device)
    score = torch.where(ok, score, torch.full_like(score, -1.0))
    n = max(1, min(max_anchors, int(ok.sum(1).max())))
    top = score.topk(n, dim=1)
    valid = top.values >= 0
    key = torch.where(valid, top.indices, torch.full_like(top.indices, t))
    key, order = key.sort(dim=1)
    valid = valid.gather(1, order)
    return torch.where(valid, key, torch.zeros_like(key)), valid


def block_targets(
    input_ids: Tensor, loss_mask: Tensor, doc_end: Tensor, anchors: Tensor, valid: Tensor, block_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """What slots 1..B-1 of each block must predict: the data token at anchor + j.

    Returns index [Bt, A, B-1] (clamped into the row), labels [Bt, A, B-1] (target ids) and
    labelled [Bt, A, B-1] (real anchor, token inside the anchor's document, loss mask 1).
    """
    t = input_ids.shape[1]
    tgt = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)
    inside = tgt < doc_end.gather(1, anchors)[..., None]
    tgt = tgt.clamp_max(t - 1)
    flat = tgt.flatten(1)
    labels = input_ids.gather(1, flat).view_as(tgt)
    labelled = valid[..., None] & inside & loss_mask.bool().gather(1, flat).view_as(tgt)
    return tgt, labels, labelled


def dflash_loss(
    model: DFlashDrafter,
    batch: PackedBatch,
    *,
    max_anchors: int,
    gamma: float,
    loss: LossKind = "tokens",
    target_head: nn.Module | None = None,
    generator: torch.Generator | None = None,
    anchors: tuple[Tensor, Tensor] | None = None,
) -> LossOutput:
    """Sample anchors, run every block in one pass, return the decayed CE and per-slot metrics.

    gamma: the recipe's ``DFlashSection.decay_gamma``; the loss is the mean over labelled
    slots weighted by w_k = exp(-(k-1)/gamma). ``anchors`` overrides the sampling.
    """
    b = model.config.block_size
    doc_start, doc_end, pos = batch.documents()
    if anchors is None:
        anchors = sample_anchors(batch.loss_mask, doc_start, doc_end, b, max_anchors, generator)
    anchor_idx, valid = anchors
    block_ids, block_pos, lo, hi = model.make_blocks(batch.input_ids, pos, doc_start, anchor_idx, valid)
    hidden = model(
        block_ids, block_pos, model.fuse_context(batch.hidden_states), pos, lo, hi, drafting_slots_only=True
    )  # [Bt, A, B-1, H]
    tgt, labels, labelled = block_targets(batch.input_ids, batch.loss_mask, doc_end, anchor_idx, valid, b)
    labels = model.vocab.to_draft(labels)
    weights = dflash_position_weights(b, gamma)[1:].to(hidden.device) * labelled
    # The head runs only on labelled slots (1..B-1; the rest carry weight 0), gathered into
    # one contiguous matrix: on the strided slice, which requires grad, the head dispatched
    # to a batched matmul that copied the weight per anchor (4x slower).
    selected = hidden[labelled]  # [M, H]
    weights = weights[labelled]

    if loss == "tokens":
        logits = model.compute_logits(selected)  # [M, Vd]
        labels_ce = labels[labelled]
        value = weighted_mean(token_cross_entropy(logits, labels_ce), weights * (labels_ce >= 0))
        argmax = logits.argmax(-1)
    elif loss == "target_logits":
        if target_head is None or batch.last_hidden is None:
            raise ValueError("loss='target_logits' needs target_head and batch.last_hidden")
        # The target predicts token i from its state at i-1. Overlapping blocks share target
        # positions: the head runs once per distinct position (<= T, not A·(B-1) rows).
        probs, rows = target_probs(target_head, batch.last_hidden, (tgt - 1).flatten(1), labelled.flatten(1))
        value, argmax = head_soft_cross_entropy(
            selected, model.lm_head, probs, rows.view_as(tgt)[labelled], weights
        )
    else:
        raise ValueError(f"unknown loss {loss!r}")

    k = b - 1
    pred = torch.full_like(labels, -1)
    pred[labelled] = argmax  # unlabelled slots never count as hits
    metrics = draft_metrics(
        pred.reshape(-1, k), labels.reshape(-1, k), labelled.reshape(-1, k), valid.reshape(-1)
    )
    return LossOutput(value, metrics)
