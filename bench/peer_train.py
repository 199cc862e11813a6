"""Training step side by side with the reference trainer (speculators 0.9.0), same run, same inputs.

    .venv/bin/python bench/peer_train.py                  # every point, two repetitions
    .venv/bin/python bench/peer_train.py --only dflash-1k --reps 1
    .venv/bin/python bench/peer_train.py --extended --only dflash-8k-3072,dflash-64k  # 3,072 anchors

On first use the reference library is installed into its own virtualenv
(``$DRAFTFLOW_HOME/peer-venv``, see ``peer_venv.py``; later runs reuse it). For every point
both trainers read the same ``inputs.safetensors`` (``peer_inputs.py``): one packed sequence
of random SmolLM2-sized hidden states (hidden 576, 9 heads / 3 KV heads, 3 context layers),
a 1-layer drafter (DFlash block 8, or Eagle3 with 3 TTT steps), draft vocab 8,192 of
49,152, the same anchor positions, the same initial weights, loss = KL to the target's
logits (final norm + head rows of the draft vocab), AdamW, fp32, 2 threads. Each trainer
runs in its own process (so peak RSS is its own): draftflow here, the reference through
``peer_driver.py`` under the peer venv's python, which drives speculators' own model classes.
Each process imports what its step needs: draftflow's side its model code and optimizer
(``draftflow.train.optim``; ``train.loop`` would add its data pipeline's pyarrow / fsspec /
pydantic, ~56 MB of RSS), the reference driver speculators' model classes, which import
transformers, datasets and pyarrow themselves (~265 MB over torch).

Printed per point: tokens/s (packed tokens / mean wall time of the timed steps, after one
warm-up step), peak RSS, and ratios: speed = reference / draftflow mean step time over the
repetitions (> 1: draftflow faster), CPU time likewise (process CPU seconds per step, less
sensitive to other processes on a shared host), RSS = draftflow / reference (< 1: smaller).
Repetitions alternate which trainer runs first.
Where the reference fails (e.g. killed for memory) the row says so.

What differs between the two steps (same result, different work):
- the reference applies its draft head and the target's head to all A·B block slots (the
  anchor slot carries weight 0); draftflow applies the draft head to the A·(B-1) predicting
  slots and the target head once per distinct target position (<= T);
- loss value: the reference's KL(p||q) summed with decay weights and divided by the number of
  labelled slots; draftflow's soft cross-entropy (= KL + H(p), same gradient) divided by the
  sum of the decay weights: the same gradient up to one scale factor per step;
- Eagle3: the reference also scores the one position per step whose predicted token lies
  past the end of the sequence (the target's distribution exists, the data token does not).
- Skipped work whose result nothing reads (same loss, same gradients): draftflow's last
  DFlash layer computes no query, MLP or norm at the anchor slot (still a key of its block);
  its Eagle3 unroll computes queries and TTT chains only at indices labelled at some step
  (the prompt's indices give their step-0 keys only); its draft head is fused into the
  soft cross-entropy (chunked, no full logits kept).
- AdamW: both torch's, same hyperparameters and update; draftflow's trainer (and its side
  here) uses the fused CPU kernel (``draftflow.train.optim.adamw``), the reference driver the
  default implementation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from peer_inputs import (  # noqa: E402 (bench/ is put on sys.path above)
    point_meta,
    reference_convention_loss,
    run_draftflow,
    write_inputs,
)
from peer_venv import ensure_peer_venv  # noqa: E402

# (name, kind, seq, anchors, ttt steps, timed steps)
POINTS = [
    ("dflash-1k-64", "dflash", 1024, 64, 0, 3),
    ("dflash-1k-256", "dflash", 1024, 256, 0, 3),
    ("dflash-1k-512", "dflash", 1024, 512, 0, 3),
    ("eagle3-1k-ttt3", "eagle3", 1024, 0, 3, 3),
    ("dflash-8k-512", "dflash", 8192, 512, 0, 2),
    ("dflash-8k-1024", "dflash", 8192, 1024, 0, 2),
]

# The published DFlash setting, 3,072 anchors, at 8k and 64k tokens (--extended; one repetition
# each: the reference takes 1 and 3 minutes a step there, and 11 and 17.5 GB).
EXTENDED_POINTS = [
    ("dflash-8k-3072", "dflash", 8192, 3072, 0, 1),
    ("dflash-64k-3072", "dflash", 65536, 3072, 0, 1),
]


def host_cpu() -> str:
    """The CPU the figures were measured on: model name, logical CPUs and widest vector ISA.
    Ratios move between hosts (the reference's step runs twice as fast on some 2-core hosts
    as on others while draftflow's moves less), so a table is only read with its host."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = next((name for flag, name in _ISA if flag in flags), "no AVX")
    return f"{model}, {os.cpu_count()} CPUs, {isa}"


_ISA = [("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")]


def run_child(cmd: list[str], timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    try:
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if proc.returncode != 0:
        killed = (
            proc.returncode in (-9, 137) or "MemoryError" in proc.stderr or "out of memory" in proc.stderr
        )
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        return {"error": "out of memory (killed)" if killed else f"exit {proc.returncode}: {tail[0][:160]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(points, reps: int, threads: int, peer_python: Path, timeout: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="draftflow-peer-") as tmp:
        for name, kind, seq, anchors, ttt, steps in points:
            folder = Path(tmp) / name
            write_inputs(folder, point_meta(kind, seq, anchors, ttt, steps, threads))
            point_reps = 1 if (name, kind, seq, anchors, ttt, steps) in EXTENDED_POINTS else reps
            for rep in range(point_reps):
                ours = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--draftflow",
                    str(folder),
                ]
                theirs = [
                    str(peer_python),
                    str(REPO / "bench" / "peer_driver.py"),
                    str(folder),
                ]
                order = [("reference", theirs), ("draftflow", ours)]
                result = {}
                for who, cmd in order if rep % 2 == 0 else order[::-1]:
                    result[who] = run_child(cmd, timeout)
                    print(
                        f"  {name} rep {rep + 1} {who}: {json.dumps(result[who])}",
                        flush=True,
                    )
                rows.append({"point": name, "rep": rep + 1, **result})
            if kind == "dflash" and seq <= 1024 and "first_loss" in result.get("reference", {}):
                ours = reference_convention_loss(folder)
                theirs = result["reference"]["first_loss"]
                print(
                    f"  {name} same-work check: first loss, speculators' convention: reference {theirs:.6f}, "
                    f"draftflow {ours:.6f} (|diff| {abs(ours - theirs):.1e})",
                    flush=True,
                )
    return rows


def _fmt(values: list, digits: int = 0) -> str:
    return " / ".join(f"{v:,.{digits}f}" for v in values) if values else "-"


def summarise(rows: list[dict]) -> list[str]:
    lines = [
        "| workload | reference tok/s | draftflow tok/s | ratio | CPU-time ratio | reference peak RSS MB "
        "| draftflow peak RSS MB | RSS ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["point"] for r in rows):
        reps = [r for r in rows if r["point"] == name]
        ref = [r["reference"] for r in reps if "error" not in r["reference"]]
        ours = [r["draftflow"] for r in reps if "error" not in r["draftflow"]]
        errors = {r[w].get("error") for r in reps for w in ("reference", "draftflow")} - {None}
        ratio = cpu = rss = "-"
        if ref and ours:

            def mean(rs, k):
                return sum(r[k] for r in rs) / len(rs)

            # mean step times: one lucky repetition counts less than in a mean of tokens/s
            ratio = f"{mean(ref, 'step_s') / mean(ours, 'step_s'):.2f}x"
            cpu = f"{mean(ref, 'cpu_s') / mean(ours, 'cpu_s'):.2f}x"
            rss = f"{mean(ours, 'peak_rss_mb') / mean(ref, 'peak_rss_mb'):.2f}x"
        ref_tps = _fmt([r["tokens_per_s"] for r in ref]) if ref else "; ".join(sorted(errors))
        rss_mb = f"{_fmt([r['peak_rss_mb'] for r in ref])} | {_fmt([r['peak_rss_mb'] for r in ours])}"
        lines.append(
            f"| {name} | {ref_tps} | {_fmt([r['tokens_per_s'] for r in ours])} | {ratio} | {cpu} | "
            f"{rss_mb} | {rss} |"
        )
    return lines


def select_points(only: str, extended: bool) -> list[tuple]:
    """The points named by ``--only`` prefixes (all when empty), from the extended set too with
    ``--extended``."""
    prefixes = [s for s in only.split(",") if s]
    candidates = POINTS + EXTENDED_POINTS if extended else POINTS
    points = [pt for pt in candidates if not prefixes or any(pt[0].startswith(s) for s in prefixes)]
    if not points:
        raise SystemExit(
            f"--only: no point matches {only!r}; points: {', '.join(pt[0] for pt in candidates)}"
        )
    return points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--only",
        default="",
        help="comma-separated name prefixes, e.g. dflash-1k,eagle3",
    )
    p.add_argument(
        "--extended",
        action="store_true",
        help="also the published 3,072-anchor setting at 8k and 64k tokens (one repetition each, ~12 min)",
    )
    p.add_argument("--timeout", type=int, default=3600, help="seconds per trainer run")
    p.add_argument("--json", help="also write the raw rows here")
    p.add_argument("--draftflow", help=argparse.SUPPRESS)  # child mode: one draftflow run
    args = p.parse_args()
    if args.draftflow:
        print(json.dumps(run_draftflow(Path(args.draftflow))))
        return
    points = select_points(args.only, args.extended)
    peer_python = ensure_peer_venv()
    rows = measure(points, args.reps, args.threads, peer_python, args.timeout)
    host = host_cpu()
    if args.json:
        Path(args.json).write_text(json.dumps({"host": host, "rows": rows}, indent=1))
    print(
        f"\n## training step vs speculators 0.9.0 (same inputs, {args.threads} threads, load: "
        f"{os.getloadavg()[0]:.1f}; {host})"
    )
    print("\n".join(summarise(rows)))


if __name__ == "__main__":
    main()
