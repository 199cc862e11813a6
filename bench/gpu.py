"""GPU benchmark: flex-attention check, then bf16 training steps at Qwen3-8B sizes.

    PYTHONUNBUFFERED=1 python bench/gpu.py --json gpu.json        # the CUDA run (~6 min on one H200)
    python bench/gpu.py --smoke --json smoke.json                   # the same code on CPU, tiny sizes
    python bench/gpu.py --points 'dflash-64k-*' --budget-s 200      # a subset (fnmatch on point names)

Needs PyTorch only (plus numpy through it): it imports ``draftflow.models`` and nothing above
it, so it runs from a plain copy of the repository on a machine with no pydantic, Prefect or
vLLM, and no package registry.

1. **Check.** The flex-attention path (compiled on GPU) against the CPU path's reference (the
   dense chunked SDPA path on CPU) on the same random fp32 weights and batch: drafter output,
   loss and every gradient, for DFlash and Eagle3 at small sizes with head_dim 128. Error =
   max |device - cpu| / max |cpu| per tensor; passes at <= ``CHECK_TOL`` (TF32 off). On CPU
   (``--smoke``) flex has no backward, so the check compares the forward output only.
2. **Points.** Training steps as the trainer takes them (fp32 master weights, bf16 autocast,
   forward + backward + grad clipping + AdamW; ``draftflow.train.loop``) of a DFlash drafter
   at Qwen3-8B dimensions (hidden 4096, 32 / 8 heads, head_dim 128, intermediate 12288, vocab
   151,936, draft vocab 32k, 5 layers, block 16, 3 context layers) on random hidden states
   packed as documents of ``--doc-len`` tokens, at pack lengths 16k / 64k and 512 / 1,536 /
   3,072 anchors; the same 64k points again with activation checkpointing per decoder layer
   (``-ckpt``); and Eagle3 (one layer, the recipe's 3 TTT steps) at 16k / 64k. The loss is
   ``--loss`` (default ``target_logits``: soft cross-entropy to the target's distribution
   from a frozen target head, the reference trainer's KL objective). Per point: one warm-up
   step (compilation included, reported apart), then timed steps between
   ``torch.cuda.synchronize()`` calls; tokens/s counts packed tokens; peak memory is
   ``torch.cuda.max_memory_allocated`` (and ``_reserved``) since the point started, model and
   optimizer state included. An OOM prints ``OOM`` and the run goes on.

Points run in priority order (the 64k points first) and a point starts only while
``--budget-s`` is not spent, so the run ends in time whatever compilation costs. Exit status:
0 when the check passed and at least one point ran, 1 otherwise, 2 without CUDA (no --smoke).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import gc
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# Fewer fragmentation OOMs after an OOM point; must be set before CUDA initialises.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from draftflow.models.common import PackedBatch  # noqa: E402
from draftflow.models.dflash import DFlashConfig, DFlashDrafter, dflash_loss, sample_anchors  # noqa: E402
from draftflow.models.eagle3 import Eagle3Config, Eagle3Drafter, eagle3_loss  # noqa: E402
from draftflow.models.target_weights import TargetHead  # noqa: E402
from draftflow.models.vocab import DraftVocab  # noqa: E402

CHECK_TOL = 2e-3
H100_USABLE_GIB = 79.0  # what an 80 GB H100 leaves to PyTorch
GAMMA, TTT_DECAY, LR, GRAD_CLIP = 7.0, 0.8, 1e-4, 1.0  # schema defaults for block 16 / Eagle3


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


QWEN3_8B = Sizes(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151_936,
                 draft_vocab=32_000, dflash_layers=5, block=16, context_layers=3, doc_len=4096,
                 packs=(16_384, 65_536), anchors=(512, 1536, 3072), ttt_steps=3)
SMOKE = Sizes(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1000, draft_vocab=256,
              dflash_layers=2, block=4, context_layers=3, doc_len=64, packs=(128, 256), anchors=(8, 16, 32),
              ttt_steps=3)
# The check: small, but head_dim and GQA as at Qwen3-8B so the flex kernels are the same kind.
CHECK = Sizes(hidden=512, heads=8, kv_heads=2, head_dim=128, intermediate=1024, vocab=4096, draft_vocab=1024,
              dflash_layers=2, block=16, context_layers=3, doc_len=256, packs=(1024,), anchors=(48,), ttt_steps=3)
SMOKE_CHECK = replace(SMOKE, packs=(128,), anchors=(8,))


@dataclass(frozen=True)
class Point:
    kind: str  # "dflash" | "eagle3"
    pack: int
    anchors: int = 0  # DFlash only
    ttt_steps: int = 0  # Eagle3 only
    checkpoint: bool = False  # activation checkpointing per decoder layer (DFlash only)

    @property
    def name(self) -> str:
        size = f"{self.pack // 1024}k" if self.pack % 1024 == 0 else str(self.pack)
        if self.kind == "eagle3":
            return f"eagle3-{size}-ttt{self.ttt_steps}"
        return f"dflash-{size}-a{self.anchors}" + ("-ckpt" if self.checkpoint else "")


def all_points(sizes: Sizes) -> list[Point]:
    """Priority order: the long pack first (the published 3,072-anchor setting at 64k), then
    the same with checkpointing (same shapes: no new compilation), Eagle3, the short pack."""
    long, short = max(sizes.packs), min(sizes.packs)
    desc = sorted(sizes.anchors, reverse=True)
    points = [Point("dflash", long, a) for a in desc]
    points += [Point("dflash", long, a, checkpoint=True) for a in desc[:2]]
    points += [Point("eagle3", p, ttt_steps=sizes.ttt_steps) for p in sorted(sizes.packs)]
    points += [Point("dflash", short, a) for a in sorted(sizes.anchors)]
    return points


QUICK = ("dflash-64k-a3072", "dflash-64k-a3072-ckpt", "eagle3-16k-*", "dflash-16k-a512")


def select(points: list[Point], patterns: list[str]) -> list[Point]:
    return [p for p in points if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]


# ----------------------------------------------------------------------------- inputs and models


def draft_vocab(sizes: Sizes) -> DraftVocab:
    ids = torch.randperm(sizes.vocab, generator=torch.Generator().manual_seed(1))[: sizes.draft_vocab]
    return DraftVocab.from_target_ids(ids, sizes.vocab)


def random_batch(sizes: Sizes, pack: int, vocab: DraftVocab, device: torch.device, seed: int = 0) -> PackedBatch:
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


def build_dflash(sizes: Sizes, vocab: DraftVocab) -> DFlashDrafter:
    cfg = DFlashConfig(
        hidden_size=sizes.hidden, intermediate_size=sizes.intermediate, num_layers=sizes.dflash_layers,
        num_heads=sizes.heads, num_kv_heads=sizes.kv_heads, head_dim=sizes.head_dim, vocab_size=sizes.vocab,
        draft_vocab_size=sizes.draft_vocab, num_context_layers=sizes.context_layers, block_size=sizes.block,
        mask_token_id=sizes.vocab - 1,
    )
    return DFlashDrafter(cfg, vocab)


def build_eagle3(sizes: Sizes, vocab: DraftVocab) -> Eagle3Drafter:
    cfg = Eagle3Config(
        hidden_size=sizes.hidden, intermediate_size=sizes.intermediate, num_heads=sizes.heads,
        num_kv_heads=sizes.kv_heads, head_dim=sizes.head_dim, vocab_size=sizes.vocab,
        draft_vocab_size=sizes.draft_vocab, num_aux_layers=sizes.context_layers, rope_theta=1_000_000.0,
    )
    return Eagle3Drafter(cfg, vocab)


def target_head(sizes: Sizes, device: torch.device) -> TargetHead:
    """The frozen target head as the trainer builds it (final norm + the draft rows of lm_head)."""
    gen = torch.Generator(device=device).manual_seed(2)
    rows = torch.randn(sizes.draft_vocab, sizes.hidden, generator=gen, device=device) * 0.02
    return TargetHead(torch.ones(sizes.hidden, device=device), rows, 1e-6)


def make_loss(kind: str, loss: str, head: TargetHead | None, max_anchors: int = 0, ttt_steps: int = 0,
              anchors=None, generator: torch.Generator | None = None):
    """The trainer's loss call (``draftflow.train.drafter.build``) for one kind."""
    if kind == "dflash":
        return lambda m, b: dflash_loss(m, b, max_anchors=max_anchors, gamma=GAMMA, loss=loss, target_head=head,
                                        generator=generator, anchors=anchors)
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
    ref = (build_dflash if kind == "dflash" else build_eagle3)(sizes, vocab)
    ref.attn_impl = "dense"
    test = copy.deepcopy(ref).to(device)
    test.attn_impl = "flex"
    batch = random_batch(sizes, sizes.packs[0], vocab, torch.device("cpu"))
    batch = replace(batch, hidden_states=batch.hidden_states.float(), last_hidden=batch.last_hidden.float())
    anchors = None
    if kind == "dflash":
        doc_start, doc_end, _ = batch.documents()
        anchors = sample_anchors(batch.loss_mask, doc_start, doc_end, sizes.block, sizes.anchors[0],
                                 torch.Generator().manual_seed(3))
    dev_anchors = None if anchors is None else tuple(a.to(device) for a in anchors)
    dev_batch = to_device(batch, device)
    errors: dict[str, float] = {}
    with torch.no_grad():
        errors["output"] = rel_err(forward_outputs(kind, test, dev_batch, dev_anchors, sizes.ttt_steps),
                                   forward_outputs(kind, ref, batch, anchors, sizes.ttt_steps))
    backward = device.type != "cpu"  # flex attention has no CPU backward
    if backward:
        head = target_head(sizes, torch.device("cpu"))
        loss_ref = make_loss(kind, loss, head, sizes.anchors[0], sizes.ttt_steps, anchors)(ref, batch).loss
        loss_ref.backward()
        head_dev = copy.deepcopy(head).to(device)
        loss_dev = make_loss(kind, loss, head_dev, sizes.anchors[0], sizes.ttt_steps, dev_anchors)(test, dev_batch).loss
        loss_dev.backward()
        errors["loss"] = rel_err(loss_dev, loss_ref)
        grads = {n: p.grad for n, p in test.named_parameters() if p.grad is not None}
        for name, p in ref.named_parameters():
            if p.grad is not None:
                errors[f"grad:{name}"] = rel_err(grads[name], p.grad) if name in grads else float("inf")
    worst = max(errors, key=errors.get)
    return {"name": f"check-{kind}", "compared": "forward + loss + grads" if backward else "forward only (CPU flex)",
            "tolerance": CHECK_TOL, "max_rel_err": errors[worst], "worst": worst,
            "passed": all(math.isfinite(e) and e <= CHECK_TOL for e in errors.values()), "tensors": len(errors)}


@contextlib.contextmanager
def no_tf32():
    """fp32 means fp32 in the check (TF32 would be ~1e-3 off by itself)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ----------------------------------------------------------------------------- one point


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


def run_point(point: Point, sizes: Sizes, device: torch.device, loss: str, min_steps: int, max_steps: int,
              min_seconds: float) -> dict:
    torch.manual_seed(0)
    vocab = draft_vocab(sizes)
    with torch.device(device):  # parameters initialised on the device (seconds saved per point)
        model = (build_dflash if point.kind == "dflash" else build_eagle3)(sizes, vocab)
    model.to(device)
    model.checkpoint_layers = point.checkpoint
    head = target_head(sizes, device) if loss == "target_logits" else None
    batch = random_batch(sizes, point.pack, vocab, device)
    gen = torch.Generator(device=device).manual_seed(4)
    loss_fn = make_loss(point.kind, loss, head, point.anchors, point.ttt_steps, generator=gen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR)
    forward_peak: list[float | None] = []

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device):
            out = loss_fn(model, batch)
        forward_peak.append(memory_gib(device)[0])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, GRAD_CLIP)
        optimizer.step()
        return float(out.loss.detach())

    sync(device)
    t0 = time.perf_counter()
    first_loss = step()
    sync(device)
    warmup_s = time.perf_counter() - t0
    steps, elapsed, last_loss = 0, 0.0, first_loss
    while steps < min_steps or (steps < max_steps and elapsed < min_seconds):
        t0 = time.perf_counter()
        last_loss = step()
        sync(device)
        elapsed += time.perf_counter() - t0
        steps += 1
    peak, reserved = memory_gib(device)
    return {
        "step_ms": 1000 * elapsed / steps, "tokens_per_s": point.pack * steps / elapsed, "timed_steps": steps,
        "warmup_s": warmup_s, "peak_gib": peak, "peak_reserved_gib": reserved,
        "forward_peak_gib": max((f for f in forward_peak if f is not None), default=None),
        "fits_80gb": None if reserved is None else reserved <= H100_USABLE_GIB,
        "first_loss": first_loss, "last_loss": last_loss,
        "finite": math.isfinite(first_loss) and math.isfinite(last_loss),
    }


def guarded(point: Point, device: torch.device, **kwargs) -> dict:
    """One point; OOM and any other error become a row of the table, never the end of the run."""
    row = {"name": point.name, **asdict(point), "status": "ok"}
    free_memory(device)
    try:
        row.update(run_point(point, device=device, **kwargs))
        if not row["finite"]:
            row["status"] = "non-finite loss"
    except torch.cuda.OutOfMemoryError:
        row["status"] = "OOM"
        row["peak_gib"], row["peak_reserved_gib"] = memory_gib(device)
    except Exception as exc:  # report it and go on: one run on the device must give every figure it can
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        traceback.print_exc()
        sys.stderr.flush()
    free_memory(device)
    return row


# ----------------------------------------------------------------------------- report


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict], order: list[str]) -> None:
    header = (f"{'point':<24} {'pack':>6} {'anch/ttt':>8} {'status':>7} {'step ms':>9} {'tokens/s':>10} "
              f"{'peak GiB':>9} {'rsvd GiB':>9} {'<=80GB':>6} {'warm-up s':>9} {'loss':>8}")
    print("\n" + header + "\n" + "-" * len(header), flush=True)
    for row in sorted(rows, key=lambda r: order.index(r["name"])):
        fits = {True: "yes", False: "no", None: "-"}[row.get("fits_80gb")]
        width = row["anchors"] if row["kind"] == "dflash" else row["ttt_steps"]
        print(f"{row['name']:<24} {row['pack']:>6} {width:>8} {row['status']:>7} "
              f"{_fmt(row.get('step_ms'), '.0f'):>9} {_fmt(row.get('tokens_per_s'), ',.0f'):>10} "
              f"{_fmt(row.get('peak_gib'), '.1f'):>9} {_fmt(row.get('peak_reserved_gib'), '.1f'):>9} {fits:>6} "
              f"{_fmt(row.get('warmup_s'), '.1f'):>9} {_fmt(row.get('last_loss'), '.3f'):>8}"
              + (f"  {row['error']}" if row.get("error") else ""), flush=True)


def configure_compile() -> None:
    """Every point is a new static shape for the compiled flex kernels; without a higher
    recompile limit dynamo would fall back to eager flex (a dense score matrix) after 8."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, the same code path")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--points", default="*", help="comma-separated fnmatch patterns on point names")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--list", action="store_true", help="print the point names and exit")
    parser.add_argument("--no-check", action="store_true", help="skip the flex-attention check")
    parser.add_argument("--loss", choices=("target_logits", "tokens"), default="target_logits")
    parser.add_argument("--doc-len", type=int, help="tokens per packed document (default 4096)")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="start no point after this many seconds of the run (one point may run past it)")
    parser.add_argument("--min-steps", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=4.0, help="time steps until this (up to --max-steps)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes, check_sizes = (SMOKE, SMOKE_CHECK) if args.smoke else (QWEN3_8B, CHECK)
    if args.doc_len:
        sizes = replace(sizes, doc_len=args.doc_len)
    order = all_points(sizes)
    patterns = list(QUICK) if args.quick else [p.strip() for p in args.points.split(",") if p.strip()]
    points = select(order, patterns)
    if args.list:
        print("\n".join(p.name for p in order))
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print(f"bench/gpu.py: no CUDA device visible (torch {torch.__version__}); "
              "run it on a CUDA machine, or pass --smoke for the CPU run", file=sys.stderr)
        return 2
    start = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    name = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name(device)
    print(f"torch {torch.__version__} on {name}; loss={args.loss}; doc_len={sizes.doc_len}; "
          f"points: {', '.join(p.name for p in points) or 'none'}", flush=True)
    if device.type == "cuda":
        configure_compile()
    checks = []
    if not args.no_check:
        for kind in ("dflash", "eagle3"):
            t0 = time.perf_counter()
            try:
                with no_tf32():
                    result = check_flex(kind, check_sizes, device, args.loss)
            except Exception as exc:  # a failed check is a result to report, not a reason to stop
                traceback.print_exc()
                result = {"name": f"check-{kind}", "passed": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
            result["seconds"] = time.perf_counter() - t0
            checks.append(result)
            print(f"{result['name']}: {'PASS' if result['passed'] else 'FAIL'} "
                  f"{result.get('compared', '')}; max rel err {_fmt(result.get('max_rel_err'), '.2e')} "
                  f"({result.get('worst', result.get('error', ''))}), tolerance {CHECK_TOL:g}; "
                  f"{result['seconds']:.1f} s", flush=True)
            free_memory(device)
    rows = []
    for point in points:
        if time.perf_counter() - start > args.budget_s:
            rows.append({"name": point.name, **asdict(point), "status": "skipped"})
            print(f"{point.name}: skipped (--budget-s {args.budget_s:g} spent)", flush=True)
            continue
        row = guarded(point, device, sizes=sizes, loss=args.loss, min_steps=args.min_steps,
                      max_steps=args.max_steps, min_seconds=0.0 if args.smoke else args.min_seconds)
        rows.append(row)
        print(f"{point.name}: {row['status']} {_fmt(row.get('tokens_per_s'), ',.0f')} tokens/s, "
              f"peak {_fmt(row.get('peak_gib'), '.1f')} GiB, warm-up {_fmt(row.get('warmup_s'), '.1f')} s "
              f"[{time.perf_counter() - start:.0f} s]", flush=True)
    print_table(rows, [p.name for p in order])
    total = time.perf_counter() - start
    passed = all(c["passed"] for c in checks)
    print(f"check {'PASS' if passed else 'FAIL'}; {sum(r['status'] == 'ok' for r in rows)}/{len(rows)} points ok; "
          f"{total:.0f} s", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "torch": torch.__version__, "device": name, "smoke": args.smoke, "loss": args.loss,
            "sizes": asdict(sizes), "check_sizes": asdict(check_sizes), "checks": checks, "points": rows,
            "total_s": total,
        }, indent=2))
    return 0 if passed and any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
