"""Benchmark: a CPU vLLM server with vLLM's own core reservation against one that computes on every core.

    .venv/bin/python bench/cpu_cores.py                         # SmolLM2, fp32, 2 repeats
    .venv/bin/python bench/cpu_cores.py --drafter EXPORT        # also the drafter's speed-up per setting

vLLM's CPU build keeps one core free of its OpenMP compute threads (for its front end) unless
VLLM_CPU_NUM_OF_RESERVED_CPU says otherwise; on a 2-core host that is half the machine. The
recipe field ``vllm.launch.cpu_reserved_cores`` sets it. For each setting a fresh plain server:
(a) batched generation: the evaluation prompts at ``--concurrency``, ``--max-tokens`` each
    (EOS ignored, so both settings generate the same number of tokens), what generation and
    extraction see;
(b) single-stream decode: ``--stream-prompts`` prompts one after the other, what a user sees;
(c) with ``--drafter``: (b) again on a server with the drafter, so the speed-up per setting.
Settings alternate (default, every core, every core, default, ...) so drift hits both; the
ratios pool all repeats (all tokens / all seconds).
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
from draftflow.recipe.load import default_home
from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port

SETTINGS = {"vLLM default (1 core kept free)": None, "every core (cpu_reserved_cores: 0)": 0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def server_spec(args: argparse.Namespace, reserved: int | None, drafter: str | None = None) -> LaunchSpec:
    return LaunchSpec(
        python=str(default_home() / "vllm-venv" / "bin" / "python"),
        model=args.model,
        port=free_port(),
        device="cpu",
        dtype=args.dtype,
        max_model_len=1024,
        cpu_reserved_cores=reserved,
        speculative_config={"model": drafter} if drafter else None,
        extra_args=["--no-enable-prefix-caching"],  # no pass profits from a cache the previous one warmed
        log_path=str(args.work_dir / f"vllm-{reserved}-{'drafter' if drafter else 'plain'}.log"),
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


def measure(args: argparse.Namespace, reserved: int | None, prompts: list[str], drafter: str | None) -> dict:
    server = ServerProcess(server_spec(args, reserved, drafter)).start()
    try:
        server.wait_healthy(600)
        step = max(1, len(prompts) // args.stream_prompts)  # spread over every category
        stream = prompts[::step][: args.stream_prompts]
        out = {"stream": asyncio.run(decode(server.spec.url, args.model, stream, 1, args.max_tokens))}
        if not drafter:
            batch = prompts[: args.batch_prompts]
            out["batch"] = asyncio.run(
                decode(server.spec.url, args.model, batch, args.concurrency, args.max_tokens)
            )
        return out
    finally:
        server.stop()


def pooled(runs: list[tuple[int, float]]) -> float:
    return sum(t for t, _ in runs) / sum(s for _, s in runs)


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    prompts = [p.text for p in load_prompt_set("draftflow-eval")]
    cases = [("target", None)] + ([("drafter", args.drafter)] if args.drafter else [])
    runs: dict[tuple[str, str, str], list] = {}
    for repeat in range(args.repeats):
        order = list(SETTINGS.items()) if repeat % 2 == 0 else list(SETTINGS.items())[::-1]
        for name, reserved in order:
            for case, drafter in cases:
                for kind, run in measure(args, reserved, prompts, drafter).items():
                    runs.setdefault((name, case, kind), []).append(run)
                    print(
                        f"repeat {repeat} {name} {case} {kind}: {run[0] / run[1]:.1f} tok/s", file=sys.stderr
                    )
    rows = {key: pooled(value) for key, value in runs.items()}
    (default, every) = SETTINGS
    print(f"\n{args.dtype}, {args.repeats} repeats per setting, tokens/s pooled\n")
    print(f"| measurement | {default} | {every} | ratio |\n|---|---|---|---|")
    for case, kind in [("target", "batch"), ("target", "stream"), ("drafter", "stream")]:
        if (default, case, kind) in rows:
            a, b = rows[(default, case, kind)], rows[(every, case, kind)]
            label = {"batch": f"batched, concurrency {args.concurrency}", "stream": "one stream"}[kind]
            print(f"| {case}, {label} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    if args.drafter:
        for name in SETTINGS:
            speedup = rows[(name, "drafter", "stream")] / rows[(name, "target", "stream")]
            print(f"drafter speed-up, {name}: {speedup:.2f}x")
    print(json.dumps({" / ".join(k): v for k, v in rows.items()}))


if __name__ == "__main__":
    main()
