"""GPU benchmark: flex-attention check, then bf16 training steps at Qwen3-8B sizes.

    PYTHONUNBUFFERED=1 python bench/gpu.py --json gpu.json        # the CUDA run (4.5 min on one H200)
    python bench/gpu.py --smoke --json smoke.json                   # the same code on CPU, tiny sizes
    python bench/gpu.py --points 'dflash-64k-*' --budget-s 200      # a subset (fnmatch on point names)

Needs PyTorch only (plus numpy through it): it imports ``draftflow.models`` and nothing above
it, so it runs from a plain copy of the repository on a machine with no pydantic, Prefect or
vLLM, and no package registry.

1. **Check.** Flex attention (compiled on GPU) against the CPU path's reference (dense
   chunked SDPA on CPU), same random fp32 weights and batch: drafter output, loss and every
   gradient, DFlash and Eagle3, head_dim 128. Error = max |device - cpu| / max |cpu| per
   tensor, passing at <= ``CHECK_TOL`` (TF32 off). On CPU flex has no backward: forward only.
2. **Points.** Training steps as the trainer takes them (fp32 master weights, bf16 autocast,
   forward, backward, grad clipping, AdamW) at Qwen3-8B dimensions (hidden 4096, 32 / 8
   heads of 128, intermediate 12288, vocab 151,936, draft vocab 32k, 3 context layers) on
   random hidden states packed as documents of ``--doc-len`` tokens: DFlash (5 layers, block
   16) at packs 16k / 64k x 512 / 1,536 / 3,072 anchors, the 64k points also with activation
   checkpointing per layer (``-ckpt``); Eagle3 (1 layer, the recipe's 3 TTT steps) at 16k /
   64k; last, the shipped qwen3-8b-dflash recipe's own step (4k pack, 3,072 anchors, block 8,
   draft vocab 8,192, token loss: ``dflash-4k-a3072-b8-v8192-tokens``). Loss ``--loss``,
   default ``target_logits`` (soft CE to a frozen target head's distribution: the reference
   trainer's KL objective). Per point: one warm-up step
   (compilation included, reported apart), then timed steps between synchronizations;
   tokens/s counts packed tokens; peak = ``torch.cuda.max_memory_allocated`` (and reserved)
   since the point started, weights and optimizer state included. OOM prints ``OOM``, goes on.

Points run in priority order and start only while ``--budget-s`` is left, so the run ends in
time whatever compilation costs; the JSON is rewritten after every point. Exit status: 0 when
the check passed and a point ran, 1 otherwise, 2 without CUDA (and without --smoke).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):  # the repository's draftflow, and gpu_models beside this file
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
# Fewer fragmentation OOMs after an OOM point; must be set before CUDA initialises.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from gpu_models import (  # noqa: E402
    CHECK,
    QWEN3_8B,
    SMOKE,
    SMOKE_CHECK,
    Sizes,
    autocast,
    build,
    draft_vocab,
    fmt,
    free_memory,
    make_loss,
    memory_gib,
    random_batch,
    run_checks,
    sync,
    target_head,
)

H100_USABLE_GIB = 79.0  # what an 80 GB H100 leaves to PyTorch
LR, GRAD_CLIP = 1e-4, 1.0  # the Qwen3-8B recipe's lr, the schema's clipping
RECIPE_BLOCK, RECIPE_DRAFT_VOCAB = 8, 8192  # recipes/qwen3-8b-dflash.yaml's drafter


@dataclass(frozen=True)
class Point:
    kind: str  # "dflash" | "eagle3"
    pack: int
    anchors: int = 0  # DFlash only
    ttt_steps: int = 0  # Eagle3 only
    checkpoint: bool = False  # activation checkpointing per decoder layer (DFlash only)
    loss: str | None = None  # None: --loss
    block: int | None = None  # None: the sizes' block
    draft_vocab: int | None = None  # None: the sizes' draft vocabulary

    @property
    def name(self) -> str:
        size = f"{self.pack // 1024}k" if self.pack % 1024 == 0 else str(self.pack)
        if self.kind == "eagle3":
            return f"eagle3-{size}-ttt{self.ttt_steps}"
        name = f"dflash-{size}-a{self.anchors}" + ("-ckpt" if self.checkpoint else "")
        if self.block:
            name += f"-b{self.block}-v{self.draft_vocab}"
        return name + (f"-{self.loss}" if self.loss else "")

    def sizes(self, sizes: Sizes) -> Sizes:
        return replace(
            sizes, block=self.block or sizes.block, draft_vocab=self.draft_vocab or sizes.draft_vocab
        )


def recipe_point(sizes: Sizes) -> Point:
    """The shipped qwen3-8b-dflash recipe's step: one pack of its pack_length (4,096, one
    document), its 3,072 anchors, block 8, draft vocabulary 8,192, cross-entropy to the data
    tokens, no checkpointing. At smoke sizes the same proportions."""
    block = sizes.block * RECIPE_BLOCK // QWEN3_8B.block
    vocab = max(16, sizes.draft_vocab * RECIPE_DRAFT_VOCAB // QWEN3_8B.draft_vocab)
    return Point("dflash", sizes.doc_len, max(sizes.anchors), loss="tokens", block=block, draft_vocab=vocab)


def all_points(sizes: Sizes) -> list[Point]:
    """Priority order: the long pack first, each anchor count followed by its checkpointed run
    (same shapes: no new compilation), the most anchors (the published 3,072) first, that one
    also with the token loss; then Eagle3; then the short pack; last the shipped recipe's step."""
    long, short = max(sizes.packs), min(sizes.packs)
    desc = sorted(sizes.anchors, reverse=True)
    points = []
    for a in desc:
        points.append(Point("dflash", long, a))
        if a != min(desc):
            points.append(Point("dflash", long, a, checkpoint=True))
        if a == max(desc):  # the shipped recipes' loss (CE to the data tokens), for its memory
            points.append(Point("dflash", long, a, checkpoint=True, loss="tokens"))
    points += [Point("eagle3", p, ttt_steps=sizes.ttt_steps) for p in sorted(sizes.packs)]
    points += [Point("dflash", short, a) for a in sorted(sizes.anchors)]
    return points + [recipe_point(sizes)]


QUICK = ("dflash-64k-a3072", "dflash-64k-a3072-ckpt", "eagle3-16k-*", "dflash-16k-a512")


def select(points: list[Point], patterns: list[str]) -> list[Point]:
    return [p for p in points if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]


# ----------------------------------------------------------------------------- one point


def run_point(
    point: Point,
    sizes: Sizes,
    device: torch.device,
    loss: str,
    min_steps: int,
    max_steps: int,
    min_seconds: float,
) -> dict:
    torch.manual_seed(0)
    sizes = point.sizes(sizes)
    vocab = draft_vocab(sizes)
    with torch.device(device):  # parameters initialised on the device (seconds saved per point)
        model = build(point.kind, sizes, vocab)
    model.to(device)
    model.checkpoint_layers = point.checkpoint
    loss = point.loss or loss
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
        "step_ms": 1000 * elapsed / steps,
        "tokens_per_s": point.pack * steps / elapsed,
        "timed_steps": steps,
        "warmup_s": warmup_s,
        "peak_gib": peak,
        "peak_reserved_gib": reserved,
        "forward_peak_gib": max((f for f in forward_peak if f is not None), default=None),
        "fits_80gb": None if reserved is None else reserved <= H100_USABLE_GIB,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "finite": math.isfinite(first_loss) and math.isfinite(last_loss),
    }


def guarded(point: Point, device: torch.device, **kwargs) -> dict:
    """One point; OOM and any other error become a row of the table, never the end of the run."""
    row = {"name": point.name, **asdict(point), "status": "ok"}
    row["loss"] = point.loss or kwargs["loss"]
    free_memory(device)
    try:
        row.update(run_point(point, device=device, **kwargs))
        if not row["finite"]:
            row["status"] = "non-finite loss"
    except torch.cuda.OutOfMemoryError:
        row["status"], row["fits_80gb"] = "OOM", False  # more than the GPU (or --cap-gib) holds
        row["peak_gib"], row["peak_reserved_gib"] = memory_gib(device)
    except Exception as exc:  # report it and go on: one run on the device must give every figure it can
        oom = "out of memory" in str(exc).lower()  # e.g. raised inside compilation, wrapped
        row["status"] = "OOM" if oom else "error"
        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        if oom:
            row["fits_80gb"] = False
            row["peak_gib"], row["peak_reserved_gib"] = memory_gib(device)
        traceback.print_exc()
        sys.stderr.flush()
    free_memory(device)
    return row


# ----------------------------------------------------------------------------- report


def print_table(rows: list[dict], order: list[str]) -> None:
    header = (
        f"{'point':<30} {'pack':>6} {'anch/ttt':>8} {'status':>7} {'step ms':>9} {'tokens/s':>10} "
        f"{'peak GiB':>9} {'fwd GiB':>8} {'rsvd GiB':>9} {'<=80GB':>6} {'warm-up s':>9} {'loss':>8}"
    )
    print("\n" + header + "\n" + "-" * len(header), flush=True)
    for row in sorted(rows, key=lambda r: order.index(r["name"])):
        fits = {True: "yes", False: "no", None: "-"}[row.get("fits_80gb")]
        width = row["anchors"] if row["kind"] == "dflash" else row["ttt_steps"]
        print(
            f"{row['name']:<30} {row['pack']:>6} {width:>8} {row['status']:>7} "
            f"{fmt(row.get('step_ms'), '.0f'):>9} {fmt(row.get('tokens_per_s'), ',.0f'):>10} "
            f"{fmt(row.get('peak_gib'), '.1f'):>9} {fmt(row.get('forward_peak_gib'), '.1f'):>8} "
            f"{fmt(row.get('peak_reserved_gib'), '.1f'):>9} {fits:>6} "
            f"{fmt(row.get('warmup_s'), '.1f'):>9} {fmt(row.get('last_loss'), '.3f'):>8}"
            + (f"  {row['error']}" if row.get("error") else ""),
            flush=True,
        )


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
    parser.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="start no point after this many seconds of the run (one point may run past it)",
    )
    parser.add_argument(
        "--cap-gib",
        type=float,
        help="let PyTorch use at most this much GPU memory (e.g. 79 to act as an 80 GB H100)",
    )
    parser.add_argument("--min-steps", type=int, default=2, help="timed steps per point, at least")
    parser.add_argument("--max-steps", type=int, default=5, help="and at most, while under --min-seconds")
    parser.add_argument("--min-seconds", type=float, default=4.0)
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
        print(
            f"bench/gpu.py: no CUDA device visible (torch {torch.__version__}); "
            "run it on a CUDA machine, or pass --smoke for the CPU run",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    name = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name(device)
    print(
        f"torch {torch.__version__} on {name}; loss={args.loss}; doc_len={sizes.doc_len}; "
        f"points: {', '.join(p.name for p in points) or 'none'}",
        flush=True,
    )
    if device.type == "cuda":
        configure_compile()
        if args.cap_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, args.cap_gib * 2**30 / total), torch.cuda.current_device()
            )
            print(f"GPU memory capped at {args.cap_gib:g} GiB of {total / 2**30:.1f}", flush=True)
    result = {
        "torch": torch.__version__,
        "device": name,
        "smoke": args.smoke,
        "loss": args.loss,
        "sizes": asdict(sizes),
        "check_sizes": asdict(check_sizes),
        "checks": [],
        "points": [],
    }

    def save() -> None:  # after every point, so a run killed at its time limit still leaves its figures
        result["total_s"] = time.perf_counter() - start
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))

    checks, rows = result["checks"], result["points"]
    if not args.no_check:
        checks += run_checks(device, check_sizes, args.loss)
        save()
    for point in points:
        if time.perf_counter() - start > args.budget_s:
            rows.append({"name": point.name, **asdict(point), "status": "skipped"})
            print(f"{point.name}: skipped (--budget-s {args.budget_s:g} spent)", flush=True)
            continue
        row = guarded(
            point,
            device,
            sizes=sizes,
            loss=args.loss,
            min_steps=args.min_steps,
            max_steps=args.max_steps,
            min_seconds=0.0 if args.smoke else args.min_seconds,
        )
        rows.append(row)
        save()
        print(
            f"{point.name}: {row['status']} {fmt(row.get('tokens_per_s'), ',.0f')} tokens/s, "
            f"peak {fmt(row.get('peak_gib'), '.1f')} GiB, warm-up {fmt(row.get('warmup_s'), '.1f')} s "
            f"[{time.perf_counter() - start:.0f} s]",
            flush=True,
        )
    print_table(rows, [p.name for p in order])
    save()
    passed = all(c["passed"] for c in checks)
    ok = sum(r["status"] == "ok" for r in rows)
    verdict = "PASS" if passed else "FAIL"
    print(f"check {verdict}; {ok}/{len(rows)} points ok; {result['total_s']:.0f} s", flush=True)
    return 0 if passed and ok else 1


if __name__ == "__main__":
    sys.exit(main())
