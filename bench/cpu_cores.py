"""Benchmark: two settings of a CPU vLLM server, side by side in one run.

    .venv/bin/python bench/cpu_cores.py                         # cores: SmolLM2, fp32, 2 repeats
    .venv/bin/python bench/cpu_cores.py --drafter EXPORT        # also the drafter's speed-up per setting
    .venv/bin/python bench/cpu_cores.py --compare engine-start  # the engine core spawned or forked
    .venv/bin/python bench/cpu_cores.py --compare dtype         # float32 or bfloat16 compute

``--compare cores``: vLLM's CPU build keeps one core free of its OpenMP compute threads (for its
front end) unless VLLM_CPU_NUM_OF_RESERVED_CPU says otherwise; on a 2-core host that is half the
machine. The recipe field ``vllm.launch.cpu_reserved_cores`` sets it.
``--compare dtype``: the dtype the server computes in, float32 (the CPU recipes' extraction and
serving) or bfloat16 (what ``data.generation_dtype: bfloat16`` gives the server that writes the
training text); batched throughput is what generation sees.
``--compare engine-start``: ``vllm.launch.cpu_engine_start`` (draftflow's vLLM plugin), the engine
core spawned as vLLM does or forked from the API server; the start-up time is what it changes, and
the decode figures check that it changes nothing else.

For each setting a fresh plain server, timed from launch to its first healthy answer:
(a) batched generation: the evaluation prompts at ``--concurrency``, ``--max-tokens`` each
    (EOS ignored, so both settings generate the same number of tokens), what generation and
    extraction see (``--batch-prompts 0`` skips it);
(b) single-stream decode: ``--stream-prompts`` prompts one after the other, what a user sees;
(c) with ``--drafter``: (b) again on a server with the drafter, so the speed-up per setting.
Settings alternate (A, B, B, A, ...) so drift hits both; the ratios pool all repeats (all tokens
/ all seconds; start-up: all seconds / all starts). Fields a comparison does not vary are the
shipped CPU recipes' (every core; the engine core forked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from draftflow.evaluation.categories import load_prompt_set
from draftflow.models import checkpoint_info
from draftflow.recipe.load import default_home
from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port

# Each setting: LaunchSpec fields. The first of a pair is the baseline (vLLM's own behaviour).
COMPARISONS = {
    "cores": {
        "vLLM default (1 core kept free)": {"cpu_reserved_cores": None},
        "every core (cpu_reserved_cores: 0)": {"cpu_reserved_cores": 0},
    },
    "dtype": {
        "float32 (the CPU recipes')": {"dtype": "float32"},
        "bfloat16": {"dtype": "bfloat16"},
    },
    "engine-start": {
        "engine core spawned (vLLM's choice)": {"cpu_engine_start": "spawn"},
        "engine core forked (cpu_engine_start: fork)": {"cpu_engine_start": "fork"},
    },
}
SHIPPED = {"cpu_reserved_cores": 0}  # the CPU recipes'; the engine start is the schema's default (fork)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", choices=sorted(COMPARISONS), default="cores")
    p.add_argument("--model", default=str(default_home() / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--drafter", help="a speculators export to serve in (c)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stream-prompts", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/draftflow-bench-cpu-cores"))
    return p.parse_args(argv)


def server_spec(args: argparse.Namespace, setting: dict, drafter: str | None = None) -> LaunchSpec:
    fields = {**SHIPPED, "dtype": args.dtype, **setting}
    name = "-".join(str(v) for v in setting.values())
    return LaunchSpec(
        python=str(default_home() / "vllm-venv" / "bin" / "python"),
        model=args.model,
        port=free_port(),
        device="cpu",
        max_model_len=1024,
        **fields,
        # vLLM needs the draft length spelled out when the drafter comes in --speculative-config
        speculative_config=(
            {"model": drafter, "num_speculative_tokens": checkpoint_info(drafter)["speculative_tokens"]}
            if drafter
            else None
        ),
        extra_args=["--no-enable-prefix-caching"],  # no pass profits from a cache the previous one warmed
        log_path=str(args.work_dir / f"vllm-{name}-{'drafter' if drafter else 'plain'}.log"),
    )


async def decode(
    url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[int, float]:
    """(completion tokens, seconds) for ``prompts`` at ``concurrency``, greedy, EOS ignored."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:

        async def one(prompt: str) -> int:
            async with gate:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                reply = await http.post("/v1/chat/completions", json=body)
                reply.raise_for_status()
                return reply.json()["usage"]["completion_tokens"]

        await one(prompts[0])  # warm-up, not counted
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return tokens, time.perf_counter() - started


def measure(args: argparse.Namespace, setting: dict, prompts: list[str], drafter: str | None) -> dict:
    launched = time.perf_counter()
    server = ServerProcess(server_spec(args, setting, drafter)).start()
    try:
        server.wait_healthy(600)
        out = {"start": (1, time.perf_counter() - launched)}  # (starts, seconds)
        if args.stream_prompts:
            step = max(1, len(prompts) // args.stream_prompts)  # spread over every category
            stream = prompts[::step][: args.stream_prompts]
            out["stream"] = asyncio.run(decode(server.spec.url, args.model, stream, 1, args.max_tokens))
        if not drafter and args.batch_prompts:
            batch = prompts[: args.batch_prompts]
            out["batch"] = asyncio.run(
                decode(server.spec.url, args.model, batch, args.concurrency, args.max_tokens)
            )
        return out
    finally:
        server.stop()


def pooled(kind: str, runs: list[tuple[int, float]]) -> float:
    """Seconds per start for a start-up, tokens per second for decoding."""
    count, seconds = sum(n for n, _ in runs), sum(s for _, s in runs)
    return seconds / count if kind == "start" else count / seconds


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    settings = COMPARISONS[args.compare]
    prompts = [p.text for p in load_prompt_set("draftflow-eval")]
    cases = [("target", None)] + ([("drafter", args.drafter)] if args.drafter else [])
    runs: dict[tuple[str, str, str], list] = {}
    for repeat in range(args.repeats):
        order = list(settings.items()) if repeat % 2 == 0 else list(settings.items())[::-1]
        for name, setting in order:
            for case, drafter in cases:
                for kind, run in measure(args, setting, prompts, drafter).items():
                    runs.setdefault((name, case, kind), []).append(run)
                    figure = f"{pooled(kind, [run]):.1f} {'s' if kind == 'start' else 'tok/s'}"
                    print(f"repeat {repeat} {name} {case} {kind}: {figure}", file=sys.stderr)
    rows = {key: pooled(key[2], value) for key, value in runs.items()}
    (base, other) = settings
    fixed = "" if args.compare == "dtype" else f"{args.dtype}, "
    print(f"\n{fixed}{args.repeats} repeats per setting, pooled\n")
    print(f"| measurement | {base} | {other} | ratio |\n|---|---|---|---|")
    for case in dict(cases):
        a, b = rows[(base, case, "start")], rows[(other, case, "start")]
        print(f"| {case} server, start to healthy (s) | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    for case, kind in [("target", "batch"), ("target", "stream"), ("drafter", "stream")]:
        if (base, case, kind) in rows:
            a, b = rows[(base, case, kind)], rows[(other, case, kind)]
            label = {"batch": f"batched, concurrency {args.concurrency}", "stream": "one stream"}[kind]
            print(f"| {case}, {label} (tok/s) | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    if args.drafter:
        for name in settings:
            speedup = rows[(name, "drafter", "stream")] / rows[(name, "target", "stream")]
            print(f"drafter speed-up, {name}: {speedup:.2f}x")
    print(json.dumps({" / ".join(k): v for k, v in rows.items()}))


if __name__ == "__main__":
    main()
