"""Identical inputs for the side-by-side training benchmark, and draftflow's side of it.

One file ``inputs.safetensors`` per point holds everything both trainers read: the packed
sequence (token ids, the three context layers, the target's last layer, loss mask), the
anchor positions, the frozen target tensors (embedding, final norm, head rows of the draft
vocabulary, d2t/t2d) and the drafter's initial weights under ``drafter.`` (names shared by
draftflow and speculators). ``point.json`` beside it holds the shape of the point.

This module runs in the project's virtualenv; ``peer_driver.py`` reads the same files in the
reference trainer's.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

# SmolLM2-135M dimensions.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
VOCAB, DRAFT_VOCAB, CONTEXT_LAYERS = 49152, 8192, 3
RMS_EPS, ROPE_THETA, BLOCK, MASK_TOKEN = 1e-5, 100000.0, 8, 0
GAMMA, TTT_DECAY, LR = 4.0, 0.8, 1e-4
PROMPT_FRACTION = 0.125  # the first tokens are "prompt": loss mask 0, never anchors


def point_meta(kind: str, seq: int, anchors: int, ttt_steps: int, steps: int, threads: int) -> dict:
    return {
        "kind": kind,
        "seq": seq,
        "anchors": anchors,
        "ttt_steps": ttt_steps,
        "steps": steps,
        "threads": threads,
        "hidden": HIDDEN,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate": INTERMEDIATE,
        "vocab": VOCAB,
        "draft_vocab": DRAFT_VOCAB,
        "context_layers": CONTEXT_LAYERS,
        "rms_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "block": BLOCK,
        "mask_token": MASK_TOKEN,
        "gamma": GAMMA,
        "ttt_decay": TTT_DECAY,
        "lr": LR,
    }


def _vocab(gen: torch.Generator):
    from draftflow.models.vocab import DraftVocab

    ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    return DraftVocab.from_target_ids(ids, VOCAB)


def build_drafter(meta: dict, vocab):
    from draftflow.models.dflash.config import DFlashConfig
    from draftflow.models.dflash.model import DFlashDrafter
    from draftflow.models.eagle3.config import Eagle3Config
    from draftflow.models.eagle3.model import Eagle3Drafter

    shape = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        rms_norm_eps=RMS_EPS,
        rope_theta=ROPE_THETA,
    )
    if meta["kind"] == "dflash":
        cfg = DFlashConfig(
            num_layers=1,
            num_context_layers=CONTEXT_LAYERS,
            block_size=BLOCK,
            mask_token_id=MASK_TOKEN,
            **shape,
        )
        model = DFlashDrafter(cfg, vocab)
    else:
        # speculators trains Eagle3 with a frozen lm_head (the target's draft rows): same here
        cfg = Eagle3Config(
            num_aux_layers=CONTEXT_LAYERS,
            norm_before_residual=True,
            freeze_lm_head=True,
            **shape,
        )
        model = Eagle3Drafter(cfg, vocab)
    model.attn_impl = "dense"
    return model


def write_inputs(folder: Path, meta: dict, seed: int = 0) -> None:
    """Random inputs for one point (same seed → same bytes)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    t, a, b = meta["seq"], meta["anchors"], BLOCK
    vocab = _vocab(gen)
    tensors = {
        "input_ids": torch.randint(0, VOCAB, (1, t), generator=gen),
        "hidden_states": torch.randn(1, t, CONTEXT_LAYERS, HIDDEN, generator=gen),
        "last_hidden": torch.randn(1, t, HIDDEN, generator=gen) * 4.0,
        "loss_mask": (torch.arange(t) >= int(t * PROMPT_FRACTION)).to(torch.int64)[None],
        "embed": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02,
        "final_norm": 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "d2t": vocab.d2t,
        "t2d": vocab.t2d,
    }
    tensors["target_head"] = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05)[vocab.target_ids()]
    # Anchors: loss-masked, a full block inside the sequence, at least one context token before
    # (both trainers' eligibility rules agree on these), sorted, all valid.
    lo = int(t * PROMPT_FRACTION)
    eligible = torch.arange(max(1, lo), t - b)
    tensors["anchors"] = eligible[torch.randperm(eligible.numel(), generator=gen)[:a]].sort().values
    torch.manual_seed(seed)
    model = build_drafter(meta, vocab)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tensors["embed"])
        model.lm_head.weight.copy_(tensors["target_head"])  # both trainers start from the target's rows
    for name, value in model.state_dict().items():
        if name not in ("d2t", "t2d", "embed_tokens.weight"):
            tensors["drafter." + name] = value
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(folder / "inputs.safetensors"),
    )
    (folder / "point.json").write_text(json.dumps(meta))


def load_draftflow(folder: Path):
    """(meta, model, batch, target head, anchors) for draftflow, from the point's files."""
    from safetensors.torch import load_file

    from draftflow.models.common import PackedBatch
    from draftflow.models.target_weights import TargetHead
    from draftflow.models.vocab import DraftVocab

    meta = json.loads((folder / "point.json").read_text())
    x = load_file(str(folder / "inputs.safetensors"))
    vocab = DraftVocab(x["d2t"], x["t2d"])
    model = build_drafter(meta, vocab)
    state = {k.removeprefix("drafter."): v for k, v in x.items() if k.startswith("drafter.")}
    state["embed_tokens.weight"] = x["embed"]
    model.load_state_dict(state, strict=False)
    batch = PackedBatch(
        input_ids=x["input_ids"],
        hidden_states=x["hidden_states"],
        loss_mask=x["loss_mask"],
        last_hidden=x["last_hidden"],
    )
    head = TargetHead(x["final_norm"], x["target_head"], RMS_EPS)
    head.use_rows_of(model.lm_head.weight)  # as the trainer does (drafter.build): one copy of the frozen rows
    anchors = x["anchors"][None]
    return (
        meta,
        model,
        batch,
        head,
        (anchors, torch.ones_like(anchors, dtype=torch.bool)),
    )


def draftflow_loss(meta: dict, model, batch, head, anchors):
    from draftflow.models.dflash.model import dflash_loss
    from draftflow.models.eagle3.model import eagle3_loss

    if meta["kind"] == "dflash":
        return dflash_loss(
            model,
            batch,
            max_anchors=meta["anchors"],
            gamma=GAMMA,
            loss="target_logits",
            target_head=head,
            anchors=anchors,
        ).loss
    return eagle3_loss(
        model,
        batch,
        steps=meta["ttt_steps"],
        decay=TTT_DECAY,
        loss="target_logits",
        target_head=head,
    ).loss


def run_draftflow(folder: Path) -> dict:
    """Warm-up step, then ``steps`` timed AdamW steps; tokens/s, peak RSS and the first loss."""
    meta = json.loads((folder / "point.json").read_text())
    torch.set_num_threads(meta["threads"])
    meta, model, batch, head, anchors = load_draftflow(folder)
    from draftflow.train.optim import adamw
    from draftflow.train.runtime import reuse_freed_memory

    reuse_freed_memory()  # what the trainer's CPU runtime sets up at start (init_runtime)

    # the trainer's optimizer (fused AdamW on CPU, same update as the reference's torch AdamW)
    opt = adamw(
        [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01
    )  # torch's default
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, cpu, losses = [], [], []
    for _ in range(1 + meta["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = draftflow_loss(meta, model, batch, head, anchors)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(float(loss.detach()))
    return step_report(meta, times, cpu, losses, base)


def step_report(
    meta: dict,
    times: list[float],
    cpu: list[float],
    losses: list[float],
    base_rss_kb: int,
) -> dict:
    """Mean over the timed steps (the first, warm-up step excluded). cpu_s: process CPU time
    per step, all threads: less sensitive than wall time to other processes on the host."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step_s = sum(times[1:]) / max(1, len(times) - 1)
    cpu_s = sum(cpu[1:]) / max(1, len(cpu) - 1)
    return {
        "step_s": round(step_s, 4),
        "tokens_per_s": round(meta["seq"] / step_s, 1),
        "cpu_s": round(cpu_s, 4),
        "peak_rss_mb": round(peak / 1024, 1),
        "rss_growth_mb": round((peak - base_rss_kb) / 1024, 1),
        "first_loss": round(losses[0], 6),
    }


@torch.no_grad()
def reference_convention_loss(folder: Path) -> float:
    """DFlash: draftflow's model on the point's inputs, loss written as speculators writes
    it (KL to the target, decay-weighted, divided by the number of labelled slots), from
    public model methods only. Equal to the reference's first loss when both do the same work."""
    from draftflow.models.dflash.model import block_targets
    from draftflow.models.losses import dflash_position_weights

    _, model, batch, head, (anchors, valid) = load_draftflow(folder)
    start, end, pos = batch.documents()
    ids, bpos, lo, hi = model.make_blocks(batch.input_ids, pos, start, anchors, valid)
    hidden = model(ids, bpos, model.fuse_context(batch.hidden_states), pos, lo, hi)
    logq = torch.log_softmax(model.compute_logits(hidden[:, :, 1:]), -1)
    tgt, _, labelled = block_targets(batch.input_ids, batch.loss_mask, end, anchors, valid, BLOCK)
    logp = torch.log_softmax(head(batch.last_hidden[0, tgt[0] - 1])[None], -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    w = dflash_position_weights(BLOCK, GAMMA)[1:] * labelled
    return float((kl * w).sum() / (labelled.sum() + 1e-5))
