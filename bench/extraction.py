"""Benchmark: the extraction pipeline's throughput against bare vLLM extraction, same server.

    .venv/bin/python bench/extraction.py                      # starts a SmolLM2 CPU server
    .venv/bin/python bench/extraction.py --endpoint http://127.0.0.1:8000 --samples 256

(a) bare: the same completion requests the pipeline sends, at the same concurrency; each
    returned file is deleted unread (after taking its lock, as the protocol requires). This
    is what the server can deliver.
(b) pipeline: ``run_extraction`` into a fresh local store — read, validate, cast, hash,
    write shards, commit fragments — timed from the first request to the last commit.

The two alternate (bare, pipeline, bare, ...) so that drift on a shared machine hits both.
Prefix caching is turned off on the server started here: every pass repeats the same
prompts, and a cache warmed by one pass would flatter the next. Target: ratio >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from draftflow.data.prepare import prepare_recipe
from draftflow.extraction import TrainSet, run_extraction
from draftflow.plan import Plan
from draftflow.recipe.load import default_home
from draftflow.store import Store
from draftflow.vllm.client import completion_payload, hidden_states_path
from draftflow.vllm.hidden_states_file import discard_hidden_states
from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port

LAYER_IDS = [2, 15, 27, 30]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", help="use this running extraction server instead of starting one")
    p.add_argument("--staging-dir", default=None, help="the --endpoint server's staging folder")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--source", choices=["chitchat", "chatterbot"], default="chitchat")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--samples-per-shard", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (both passes)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=str(default_home() / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--work-dir", default=None, help="default: a temporary folder, removed afterwards")
    return p.parse_args()


def write_recipe(args: argparse.Namespace, work: Path, endpoint: str, staging: str | None = None) -> str:
    recipe = {
        "name": "bench-extraction",
        "target": {"model": args.model},
        "data": {
            "sources": [{"kind": args.source, "max_samples": args.samples}],
            "num_samples": args.samples,
            "eval_samples": 0,
            "max_length": args.max_length,
        },
        "extraction": {
            "layer_ids": LAYER_IDS,
            "dtype": "float32",
            "store": str(work / "store"),
            "samples_per_shard": args.samples_per_shard,
            "concurrency": args.concurrency,
        },
        "vllm": {"endpoints": [endpoint], **({"staging_dirs": [staging]} if staging else {})},
        "drafter": {"kind": "dflash"},
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


async def bare_pass(endpoint: str, prompts: list[list[int]], concurrency: int) -> float:
    """Seconds to send every prompt and delete each returned file unread (lock honoured)."""
    async with httpx.AsyncClient(base_url=endpoint, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        pending = iter(prompts)

        async def worker() -> None:
            for prompt in pending:  # the shared iterator gives each prompt to one worker
                response = await http.post("/v1/completions", json=completion_payload(model, prompt))
                response.raise_for_status()
                path = hidden_states_path(response.json(), endpoint, prompt)
                await asyncio.to_thread(discard_hidden_states, path)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def pipeline_pass(recipe: str, work: Path, prepared_from: str, index: int) -> tuple[float, int]:
    """(seconds, tokens) of run_extraction into a fresh local store holding only prepared data."""
    store_dir = work / f"store-{index}"
    plan = Plan.load(recipe, [f"extraction.store={store_dir}"])
    shutil.copytree(Path(prepared_from) / "prepared", Path(plan.data.root) / "prepared")
    summary = run_extraction(plan, launch=None, verify=False)
    if not summary.ok or summary.shards_written == 0:
        raise RuntimeError(f"pipeline pass failed:\n{summary}")
    shutil.rmtree(store_dir)
    return summary.seconds, summary.tokens


def main() -> int:
    args = parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="draftflow-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        spec = LaunchSpec(
            python=str(default_home() / "vllm-venv" / "bin" / "python"),
            model=args.model,
            port=free_port(),
            device="cpu",
            dtype="float32",
            max_model_len=max(1024, args.max_length + 1),
            extract_layer_ids=LAYER_IDS,
            staging_dir=tempfile.mkdtemp(prefix="draftflow-bench-", dir="/dev/shm"),
            extra_args=["--no-enable-prefix-caching"],
            log_path=str(work / "vllm.log"),
        )
        print(f"starting vLLM ({spec.url}, log {spec.log_path}) ...", file=sys.stderr)
        server = ServerProcess(spec).start()
    try:
        if server is not None:
            server.wait_healthy(300)
            endpoint = server.url
        recipe = write_recipe(args, work, endpoint, server.spec.staging_dir if server else args.staging_dir)
        plan = Plan.load(recipe)
        prepare_recipe(plan.recipe, plan.data)
        train = TrainSet.load(Store(plan.data))
        prompts = [train.tokens(e.sample_id)[0].tolist() for e in train.expected()]
        tokens = sum(len(p) for p in prompts)
        print(
            f"{len(prompts)} samples, {tokens} tokens (mean {tokens / len(prompts):.0f}), "
            f"concurrency {args.concurrency}, {args.samples_per_shard} samples per shard",
            file=sys.stderr,
        )
        asyncio.run(bare_pass(endpoint, prompts[:8], args.concurrency))  # warm-up, not measured

        bare, pipe = [], []
        for i in range(args.repeats):
            seconds = asyncio.run(bare_pass(endpoint, prompts, args.concurrency))
            bare.append(tokens / seconds)
            print(f"repeat {i + 1}: bare      {seconds:6.2f}s  {bare[-1]:8.0f} tokens/s", file=sys.stderr)
            seconds, stored = pipeline_pass(recipe, work, plan.data.root, i)
            assert stored == tokens, (stored, tokens)
            pipe.append(tokens / seconds)
            print(f"repeat {i + 1}: pipeline  {seconds:6.2f}s  {pipe[-1]:8.0f} tokens/s", file=sys.stderr)
        b, p = statistics.median(bare), statistics.median(pipe)
        print(f"bare extraction   {b:8.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in bare)})")
        print(f"pipeline → store  {p:8.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in pipe)})")
        print(f"ratio             {p / b:8.3f}  (target >= 0.9)")
        return 0
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.spec.staging_dir, ignore_errors=True)
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
