"""Benchmark: FP8 hidden-state storage against bf16, on real SmolLM2 states from vLLM.

    .venv/bin/python bench/fp8.py                                   # small budget (~64 samples)
    .venv/bin/python bench/fp8.py --samples 216 --epochs 20         # the old demo recipe's budget
    .venv/bin/python bench/fp8.py --samples 216 --epochs 20 --seeds 2 --work-dir DIR  # + noise
    .venv/bin/python bench/fp8.py --skip-tau                        # bytes and error only

One vLLM CPU server (fp32, started here) prepares the data once and extracts the same samples
three times, into float32 (the reference), bfloat16 and FP8 (``--fp8``, default float8_e4m3)
stores. Then, with that server stopped:

1. bytes per token of each store (hidden states + FP8 scales, and the whole per-sample range
   with token id and mask, from the manifest) and the ratio to bf16 (target <= 0.55x);
2. reconstruction error of bf16 and FP8 against fp32, per extracted layer: relative L2 error
   over all tokens, and the largest |error| relative to its row's amax;
3. unless ``--skip-tau``: the same recipe (seed, data, drafter, schedule) trained from the bf16
   store and from the FP8 store, each drafter evaluated in vLLM (a server per evaluation, as
   ``draftflow evaluate --vllm`` does); τ of both and the relative gap (target within 3%).
   With ``--seeds N`` each store trains N times (training.seed 0..N-1): the gap is taken
   between the means, and the bf16 seed-to-seed spread is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from draftflow.evaluation.report import Evaluation
from draftflow.evaluation.run import evaluate_checkpoint
from draftflow.extraction import run_extraction
from draftflow.plan import Plan
from draftflow.recipe.load import default_home
from draftflow.results import TrainResult
from draftflow.store import Store, load_sample, read_manifest
from draftflow.store.fp8 import FP8_FORMATS
from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port

LAYER_IDS = [2, 15, 27, 30]  # SmolLM2's default (2, L//2, L-3, L)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64, help="conversations (train + eval)")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="training seeds per store (training.seed 0..N-1): the spread between seeds of one "
        "store says how much of the bf16/FP8 gap is training noise",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fp8", choices=sorted(FP8_FORMATS), default="float8_e4m3")
    p.add_argument("--no-regenerate", action="store_true", help="train on the corpus replies, not SmolLM2's")
    p.add_argument("--skip-tau", action="store_true", help="only bytes and reconstruction error")
    p.add_argument("--model", default=str(default_home() / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--work-dir", default=None, help="default: a temporary folder, removed afterwards")
    return p.parse_args()


def recipe(args: argparse.Namespace, work: Path, endpoint: str, staging: str, dtype: str) -> str:
    """The demo recipe's shape at the benchmark's budget; only ``extraction.dtype`` differs."""
    chatterbot = max(1, args.samples * 3 // 4)
    data = {
        "name": f"bench-fp8-{dtype}",
        "target": {"model": args.model},
        "data": {
            "sources": [
                {"kind": "chatterbot", "max_samples": chatterbot},
                {"kind": "chitchat", "max_samples": args.samples - chatterbot + 8},
            ],
            "num_samples": args.samples,
            "eval_samples": args.eval_prompts,
            "max_length": 320,
            "regenerate_responses": not args.no_regenerate,
            "regenerate_max_tokens": 96,
        },
        "extraction": {
            "layer_ids": LAYER_IDS,
            "dtype": dtype,
            "store": str(work / "store"),
            "samples_per_shard": 16,
        },
        "vllm": {
            "endpoints": [endpoint],
            "staging_dirs": [staging],  # the server's: files it names elsewhere are refused
            "launch": {"device": "cpu", "max_model_len": 1024},
        },
        "drafter": {
            "kind": "dflash",
            "block_size": 4,
            "max_anchors": 128,
            "num_layers": 1,
            "draft_vocab_size": 8192,
        },
        "training": {
            "epochs": args.epochs,
            "lr": 3.0e-3,
            "pack_length": 1024,
            "device": "cpu",
            "log_every": 25,
            "run_dir": str(work / "runs"),
        },
        "evaluation": {
            "num_prompts": args.eval_prompts,
            "max_new_tokens": args.max_new_tokens,
            "agreement_tolerance": 0.5,
        },
    }
    path = work / f"recipe-{dtype}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def extract_all(args: argparse.Namespace, work: Path, dtypes: list[str]) -> dict[str, Plan]:
    """One fp32 server; data prepared once (reference recipe), copied to the other data folders."""
    spec = LaunchSpec(
        python=str(default_home() / "vllm-venv" / "bin" / "python"),
        model=args.model,
        port=free_port(),
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        extract_layer_ids=LAYER_IDS,
        staging_dir=tempfile.mkdtemp(prefix="draftflow-bench-fp8-", dir="/dev/shm"),
        log_path=str(work / "vllm-extract.log"),
    )
    print(f"starting the extraction server ({spec.url}, log {spec.log_path}) ...", file=sys.stderr)
    server = ServerProcess(spec).start()
    plans: dict[str, Plan] = {}
    try:
        server.wait_healthy(900)
        for dtype in dtypes:
            plan = Plan.load(recipe(args, work, server.url, spec.staging_dir, dtype))
            if plans:  # the same prepared samples (and regenerated replies) for every store
                first = next(iter(plans.values()))
                shutil.copytree(first.data.prepared_dir, plan.data.prepared_dir, dirs_exist_ok=True)
            started = time.perf_counter()
            summary = run_extraction(plan, launch=None, verify=False)
            if not summary.ok:
                raise RuntimeError(f"extraction as {dtype} failed:\n{summary}")
            print(
                f"extracted {summary.samples_ok} samples ({summary.tokens} tokens) as {dtype} "
                f"in {time.perf_counter() - started:.0f}s",
                file=sys.stderr,
            )
            plans[dtype] = plan
    finally:
        server.stop()
        shutil.rmtree(spec.staging_dir, ignore_errors=True)
    return plans


def bytes_per_token(plan: Plan) -> tuple[float, float, int]:
    """(hidden states + scales, whole sample range) bytes per token, and the token count."""
    rows = [r for r in read_manifest(Store(plan.data)).to_pylist() if r["status"] == "ok"]
    tokens = sum(r["num_tokens"] for r in rows)
    hidden = sum(
        r["hidden_states_offset"]
        + r["hidden_states_length"]
        - (r["token_ids_offset"] + r["token_ids_length"])
        for r in rows
    )  # values + scales
    whole = sum(r["loss_mask_offset"] + r["loss_mask_length"] - r["token_ids_offset"] for r in rows)
    return hidden / tokens, whole / tokens, tokens


def reconstruction(reference: Plan, other: Plan) -> tuple[list[float], list[float]]:
    """Per layer: relative L2 error over all tokens, and max over rows of max|error| / row amax."""
    ref_store, other_store = Store(reference.data), Store(other.data)
    ref_manifest, other_manifest = read_manifest(ref_store), read_manifest(other_store)
    err_sq = ref_sq = torch.zeros(len(LAYER_IDS), dtype=torch.float64)
    worst = torch.zeros(len(LAYER_IDS), dtype=torch.float64)
    for sample_id in ref_manifest["sample_id"].to_pylist():
        want = load_sample(ref_store, ref_manifest, sample_id).hidden_states.double()
        got = load_sample(other_store, other_manifest, sample_id).hidden_states.double()
        err = got - want
        err_sq = err_sq + err.square().sum(dim=(0, 2))
        ref_sq = ref_sq + want.square().sum(dim=(0, 2))
        amax = want.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
        worst = torch.maximum(worst, (err.abs().amax(-1) / amax).amax(0))
    return (err_sq / ref_sq).sqrt().tolist(), worst.tolist()


def train(recipe_path: str, run_id: str, seed: int) -> TrainResult:
    """A run id that already finished resumes at its last checkpoint and only exports again."""
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftflow.train",
            recipe_path,
            "--run-id",
            run_id,
            "--set",
            f"training.seed={seed}",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"training {run_id} failed:\n{proc.stderr[-3000:]}")
    result = TrainResult.from_output(proc.stdout.splitlines())
    seconds = time.perf_counter() - started
    print(f"trained {run_id}: {result.steps} steps in {seconds:.0f}s", file=sys.stderr)
    return result


def evaluate(export_dir: str, plan: Plan, out_dir: Path) -> Evaluation:
    """The drafter served by vLLM; an evaluation already written there is read back instead."""
    report = out_dir / "report.json"
    if report.exists():
        return Evaluation.from_dict(json.loads(report.read_text()))
    started = time.perf_counter()
    evaluation = evaluate_checkpoint(export_dir, plan, in_vllm=True, out_dir=str(out_dir))
    print(f"evaluated {out_dir.name} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return evaluation


def main() -> int:
    args = parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="draftflow-bench-fp8-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        plans = extract_all(args, work, ["float32", "bfloat16", args.fp8])
        bf16_hidden, bf16_whole, tokens = bytes_per_token(plans["bfloat16"])
        train_samples = len(read_manifest(Store(plans["bfloat16"].data)))
        print(f"\n{train_samples} train samples, {tokens} tokens, {len(LAYER_IDS)} layers x 576 per token")
        print("| store | hidden states (+ scales) B/token | x bf16 | whole sample B/token | x bf16 |")
        print("|---|---|---|---|---|")
        for dtype in ("float32", "bfloat16", args.fp8):
            hidden, whole, _ = bytes_per_token(plans[dtype])
            print(
                f"| {dtype} | {hidden:.1f} | {hidden / bf16_hidden:.4f} | {whole:.1f} "
                f"| {whole / bf16_whole:.4f} |"
            )

        print("\nreconstruction error against the fp32 store, per extracted layer " + str(LAYER_IDS))
        print("| store | relative L2 error per layer | max abs error / row amax per layer |")
        print("|---|---|---|")
        for dtype in ("bfloat16", args.fp8):
            rel, worst = reconstruction(plans["float32"], plans[dtype])
            rel_text, worst_text = (" / ".join(f"{x:.2e}" for x in xs) for xs in (rel, worst))
            print(f"| {dtype} | {rel_text} | {worst_text} |")
        sys.stdout.flush()
        if args.skip_tau:
            return 0

        taus: dict[str, list[tuple[float, int | None, int]]] = {}  # (τ, identical outputs, prompts)
        for dtype in ("bfloat16", args.fp8):
            for seed in range(args.seeds):
                run_id = dtype if seed == 0 else f"{dtype}-seed{seed}"
                result = train(str(plans[dtype].recipe_path), run_id, seed)
                served = evaluate(result.export_dir, plans[dtype], work / f"eval-{run_id}").vllm
                taus.setdefault(dtype, []).append(
                    (served.mean_acceptance_length, served.outputs_identical, served.num_prompts)
                )
        print(
            f"\nτ in vLLM, same recipe ({train_samples} train samples, "
            f"{args.epochs} epochs, {args.eval_prompts} held-out prompts, "
            f"{args.max_new_tokens} new tokens), training seeds 0..{args.seeds - 1}"
        )
        print("| trained from | τ in vLLM per seed | mean | lossless outputs |")
        print("|---|---|---|---|")
        means = {}
        for dtype, runs in taus.items():
            means[dtype] = sum(t for t, _, _ in runs) / len(runs)
            per_seed = " / ".join(f"{t:.4f}" for t, _, _ in runs)
            lossless = " / ".join(f"{same}/{n}" for _, same, n in runs)
            print(f"| {dtype} | {per_seed} | {means[dtype]:.4f} | {lossless} |")
        base, fp8 = means["bfloat16"], means[args.fp8]
        print(f"relative gap of the means {abs(fp8 - base) / base:.2%} (target within 3%)")
        if args.seeds > 1:
            spread = max(t for t, _, _ in taus["bfloat16"]) - min(t for t, _, _ in taus["bfloat16"])
            print(f"bf16 seed-to-seed spread {spread / base:.2%} of its mean (training noise)")
        return 0
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
