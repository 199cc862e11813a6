"""Inputs, drafters and the flex-attention check for ``bench/gpu.py`` (PyTorch and draftflow.models only)."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
import traceback
from dataclasses import dataclass, replace

import torch

from draftflow.models.common import PackedBatch
from draftflow.models.dflash import DFlashConfig, DFlashDrafter, dflash_loss, sample_anchors
from draftflow.models.eagle3 import Eagle3Config, Eagle3Drafter, eagle3_loss
from draftflow.models.target_weights import TargetHead
from draftflow.models.vocab import DraftVocab

CHECK_TOL = 2e-3
GAMMA, TTT_DECAY = 7.0, 0.8  # the schema defaults for block 16 and for Eagle3


@dataclass(frozen=True)
class Sizes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    dflash_layers: int
    block: int
    context_layers: int
    doc_len: int
    packs: tuple[int, ...]
    anchors: tuple[int, ...]
    ttt_steps: int


QWEN3_8B = Sizes(
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=12288,
    vocab=151_936,
    draft_vocab=32_000,
    dflash_layers=5,
    block=16,
    context_layers=3,
    doc_len=4096,
    packs=(16_384, 65_536),
    anchors=(512, 1536, 3072),
    ttt_steps=3,
)
SMOKE = Sizes(
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    vocab=1000,
    draft_vocab=256,
    dflash_layers=2,
    block=4,
    context_layers=3,
    doc_len=64,
    packs=(128, 256),
    anchors=(8, 16, 32),
    ttt_steps=3,
)
# The check: small, but head_dim and GQA as at Qwen3-8B so the flex kernels are the same kind.
CHECK = Sizes(
    hidden=512,
    heads=8,
    kv_heads=2,
    head_dim=128,
    intermediate=1024,
    vocab=4096,
    draft_vocab=1024,
    dflash_layers=2,
    block=16,
    context_layers=3,
    doc_len=256,
    packs=(1024,),
    anchors=(48,),
    ttt_steps=3,
)
SMOKE_CHECK = replace(SMOKE, packs=(128,), anchors=(8,))


# ----------------------------------------------------------------------------- inputs and models


def draft_vocab(sizes: Sizes) -> DraftVocab:
    ids = torch.randperm(sizes.vocab, generator=torch.Generator().manual_seed(1))[: sizes.draft_vocab]
    return DraftVocab.from_target_ids(ids, sizes.vocab)


def random_batch(
    sizes: Sizes, pack: int, vocab: DraftVocab, device: torch.device, seed: int = 0
) -> PackedBatch:
    """One packed row of documents of ``doc_len`` tokens; tokens drawn from the draft vocab,
    hidden states N(0, 1) in bf16 (the extraction dtype), every token counts for the loss."""
    gen = torch.Generator(device=device).manual_seed(seed)
    target_ids = vocab.target_ids().to(device)
    pick = torch.randint(target_ids.numel(), (1, pack), generator=gen, device=device)
    shape = (1, pack, sizes.context_layers, sizes.hidden)
    return PackedBatch(
        input_ids=target_ids[pick],
        hidden_states=torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16),
        loss_mask=torch.ones(1, pack, dtype=torch.long, device=device),
        doc_ids=(torch.arange(pack, device=device) // sizes.doc_len)[None],
        last_hidden=torch.randn(1, pack, sizes.hidden, generator=gen, device=device, dtype=torch.bfloat16),
    )


def to_device(batch: PackedBatch, device: torch.device) -> PackedBatch:
    return PackedBatch(**{k: None if v is None else v.to(device) for k, v in vars(batch).items()})


def build(kind: str, sizes: Sizes, vocab: DraftVocab) -> DFlashDrafter | Eagle3Drafter:
    common = dict(
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_heads=sizes.heads,
        num_kv_heads=sizes.kv_heads,
        head_dim=sizes.head_dim,
        vocab_size=sizes.vocab,
        draft_vocab_size=sizes.draft_vocab,
    )
    if kind == "dflash":
        return DFlashDrafter(
            DFlashConfig(
                **common,
                num_layers=sizes.dflash_layers,
                block_size=sizes.block,
                num_context_layers=sizes.context_layers,
                mask_token_id=sizes.vocab - 1,
            ),
            vocab,
        )
    return Eagle3Drafter(
        Eagle3Config(**common, num_aux_layers=sizes.context_layers, rope_theta=1_000_000.0), vocab
    )


def target_head(sizes: Sizes, device: torch.device) -> TargetHead:
    """The frozen target head as the trainer builds it (final norm + the draft rows of lm_head)."""
    gen = torch.Generator(device=device).manual_seed(2)
    rows = torch.randn(sizes.draft_vocab, sizes.hidden, generator=gen, device=device) * 0.02
    return TargetHead(torch.ones(sizes.hidden, device=device), rows, 1e-6)


def make_loss(
    kind: str,
    loss: str,
    head: TargetHead | None,
    max_anchors: int = 0,
    ttt_steps: int = 0,
    anchors=None,
    generator: torch.Generator | None = None,
):
    """The trainer's loss call (``draftflow.train.drafter.build``) for one kind."""
    if kind == "dflash":
        return lambda m, b: dflash_loss(
            m,
            b,
            max_anchors=max_anchors,
            gamma=GAMMA,
            loss=loss,
            target_head=head,
            generator=generator,
            anchors=anchors,
        )
    return lambda m, b: eagle3_loss(m, b, steps=ttt_steps, decay=TTT_DECAY, loss=loss, target_head=head)


def autocast(device: torch.device):
    """As ``draftflow.train.runtime``: bf16 autocast on CUDA, plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- the check


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.detach().float().cpu()
    return float((got.detach().float().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def forward_outputs(kind: str, model, batch: PackedBatch, anchors, ttt_steps: int) -> torch.Tensor:
    """The drafter's own output (before any head), the part attention decides."""
    doc_start, doc_end, pos = batch.documents()
    if kind == "dflash":
        ids, block_pos, lo, hi = model.make_blocks(batch.input_ids, pos, doc_start, *anchors)
        return model(ids, block_pos, model.fuse_context(batch.hidden_states), pos, lo, hi)
    return torch.stack(model.forward_ttt(batch.input_ids, batch.hidden_states, pos, doc_start, ttt_steps))


def check_flex(kind: str, sizes: Sizes, device: torch.device, loss: str) -> dict:
    """Flex attention on ``device`` against the dense path on CPU; same fp32 weights and batch."""
    torch.manual_seed(0)
    vocab = draft_vocab(sizes)
    ref = build(kind, sizes, vocab)
    ref.attn_impl = "dense"
    test = copy.deepcopy(ref).to(device)
    test.attn_impl = "flex"
    batch = random_batch(sizes, sizes.packs[0], vocab, torch.device("cpu"))
    batch = replace(batch, hidden_states=batch.hidden_states.float(), last_hidden=batch.last_hidden.float())
    anchors = None
    if kind == "dflash":
        doc_start, doc_end, _ = batch.documents()
        anchors = sample_anchors(
            batch.loss_mask,
            doc_start,
            doc_end,
            sizes.block,
            sizes.anchors[0],
            torch.Generator().manual_seed(3),
        )
    dev_anchors = None if anchors is None else tuple(a.to(device) for a in anchors)
    dev_batch = to_device(batch, device)
    errors: dict[str, float] = {}
    with torch.no_grad():
        errors["output"] = rel_err(
            forward_outputs(kind, test, dev_batch, dev_anchors, sizes.ttt_steps),
            forward_outputs(kind, ref, batch, anchors, sizes.ttt_steps),
        )
    backward = device.type != "cpu"  # flex attention has no CPU backward
    if backward:
        head = target_head(sizes, torch.device("cpu"))
        loss_ref = make_loss(kind, loss, head, sizes.anchors[0], sizes.ttt_steps, anchors)(ref, batch).loss
        loss_ref.backward()
        head_dev = copy.deepcopy(head).to(device)
        loss_dev = make_loss(kind, loss, head_dev, sizes.anchors[0], sizes.ttt_steps, dev_anchors)(
            test, dev_batch
        ).loss
        loss_dev.backward()
        errors["loss"] = rel_err(loss_dev, loss_ref)
        grads = {n: p.grad for n, p in test.named_parameters() if p.grad is not None}
        for name, p in ref.named_parameters():
            if p.grad is not None:
                errors[f"grad:{name}"] = rel_err(grads[name], p.grad) if name in grads else float("inf")
    worst = max(errors, key=errors.get)
    return {
        "name": f"check-{kind}",
        "compared": "forward + loss + grads" if backward else "forward only (CPU flex)",
        "tolerance": CHECK_TOL,
        "max_rel_err": errors[worst],
        "worst": worst,
        "passed": all(math.isfinite(e) and e <= CHECK_TOL for e in errors.values()),
        "tensors": len(errors),
    }


@contextlib.contextmanager
def no_tf32():
    """fp32 means fp32 in the check (TF32 would be ~1e-3 off by itself)."""
    try:
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    except Exception as exc:  # another torch's TF32 switches: say so, the tolerance tells
        print(f"could not switch TF32 off: {exc}", flush=True)
        saved = None
    try:
        yield
    finally:
        if saved is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def run_checks(device: torch.device, sizes: Sizes, loss: str) -> list[dict]:
    checks = []
    for kind in ("dflash", "eagle3"):
        t0 = time.perf_counter()
        try:
            with no_tf32():
                result = check_flex(kind, sizes, device, loss)
        except Exception as exc:  # a failed check is a result to report, not a reason to stop
            traceback.print_exc()
            result = {"name": f"check-{kind}", "passed": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        result["seconds"] = time.perf_counter() - t0
        checks.append(result)
        print(
            f"{result['name']}: {'PASS' if result['passed'] else 'FAIL'} {result.get('compared', '')}; "
            f"max rel err {fmt(result.get('max_rel_err'), '.2e')} "
            f"({result.get('worst', result.get('error', ''))}), tolerance {CHECK_TOL:g}; "
            f"{result['seconds']:.1f} s",
            flush=True,
        )
        free_memory(device)
    return checks


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_gib(device: torch.device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
