"""Benchmark: does a refresh keep up with drifting traffic, and at what cost against a full retrain?

    .venv/bin/python bench/refresh.py                      # 160 conversations a window, 2 speed rounds
    .venv/bin/python bench/refresh.py --per-window 320 --speed-rounds 3 --work /dev/shm/refresh

Drift, simulated on this CPU with the target writing its own traffic (self-generated
conversations: user turns and replies by SmolLM2 through vLLM), logged as a gateway would:

- window 1: topics chat, advice, trivia;   window 2: topics coding, math, howto.

The shipped refresh recipe (`recipes/smollm2-135m-dflash-cpu-refresh.yaml`) then runs as its
stages would on a schedule, each stage timed:

1. window 1: `draftflow extract` (a new segment), `draftflow train` from scratch, evaluate and
   publish: the drafter in service (the *champion*, stale once traffic moves);
2. window 2: `draftflow extract` (only the new conversations), then
   - the **refresh**: `draftflow train --init-from <champion>` (warm start, `refresh.epochs`,
     `refresh.replay` of window 1);
   - the **full retrain**: `draftflow train` from scratch on both windows (`refresh.replay=1.0`,
     `training.epochs`), what a team without refresh would run.
3. one race in vLLM on window 2's held-out conversations (never trained on): the target alone, the
   champion, the refreshed drafter and the full retrain, fresh servers each round, interleaved
   prompt by prompt; τ from vLLM's counters, speed-up over the same target-alone passes.

Printed: one row per drafter (τ, speed-up, per round) and the wall times: refresh = window 2's
extraction + its warm training; full retrain = both windows' extraction + its training. The
goals (issue 46): the refresh's τ ≥ the full retrain's − 0.02 at ≤ 0.5x its wall time, and ≥ the
champion's + 0.10.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DRAFTFLOW = str(Path(sys.executable).with_name("draftflow"))
RECIPE = REPO / "recipes" / "smollm2-135m-dflash-cpu-refresh.yaml"
TOPICS = {1: ["chat", "advice", "trivia"], 2: ["coding", "math", "howto"]}
NO_GATE = ["evaluation.min_acceptance_length=1.0", "evaluation.min_speedup=null"]


def run(argv: list[str], log: Path) -> tuple[str, float]:
    """Run a draftflow command (output to ``log``): its output and wall seconds."""
    print("$ " + " ".join(argv), flush=True)
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[1]} failed (exit {proc.returncode}); log: {log}\n{proc.stdout[-2000:]}")
    return proc.stdout, time.monotonic() - started


def sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def write_traffic(args: argparse.Namespace, window: int, logs: Path) -> int:
    """The target's own conversations on the window's topics, logged as a gateway would."""
    from draftflow.data.dataset import load_prepared
    from draftflow.extraction.run import prepare_data
    from draftflow.plan import Plan

    generator = {
        "name": f"refresh-bench-traffic-{window}",
        "target": {"model": "${DRAFTFLOW_HOME}/models/SmolLM2-135M-Instruct"},
        "data": {
            "sources": [
                {
                    "kind": "self_generated",
                    "self_generated": {
                        "num_prompts": args.per_window,
                        "topics": TOPICS[window],
                        "max_tokens": 64,
                    },
                }
            ],
            "eval_samples": 0,
            "max_length": 320,
            "seed": window,
            "regenerate_max_tokens": 160,
            "regenerate_concurrency": 64,
        },
        "extraction": {"store": str(args.work / "traffic-store")},
        "vllm": {"endpoints": ["http://127.0.0.1:8765"], "launch": {"device": "cpu", "max_model_len": 1024}},
        "drafter": {"kind": "dflash"},
    }
    path = args.work / f"traffic-{window}.yaml"
    path.write_text(yaml.safe_dump(generator, sort_keys=False))
    plan = Plan.load(str(path))
    prepare_data(plan, launch=plan.recipe.vllm.launch)
    rows = load_prepared(plan.data, "train").select(["messages"]).to_pylist()
    at = datetime.now(UTC)
    lines = []
    for n, row in enumerate(rows):
        messages = json.loads(row["messages"])
        when = (at + timedelta(milliseconds=n)).isoformat()
        reply = {"choices": [{"message": messages[-1]}]}
        lines.append(
            json.dumps({"timestamp": when, "request": {"messages": messages[:-1]}, "response": reply})
        )
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"window-{window}.jsonl").write_text("\n".join(lines) + "\n")
    time.sleep(1.2)  # a run's window ends at its start, to the second: after these lines
    return len(lines)


def export_of(output: str) -> str:
    result = next(line for line in output.splitlines() if line.startswith("DRAFTFLOW_RESULT "))
    return json.loads(result.split(" ", 1)[1])["export_dir"]


def race(recipe: Path, overrides: list[str], drafters: dict[str, str], rounds: int, out: Path) -> list[dict]:
    """Every drafter and the target alone on the newest segment's held-out prompts, one race."""
    from draftflow.data.chat import load_chat_encoder
    from draftflow.evaluation.in_vllm import (
        GenerationRun,
        LaunchServerFactory,
        counters_report,
        decode_rounds,
        speed_summary,
    )
    from draftflow.evaluation.run import load_eval_prompts
    from draftflow.models import checkpoint_info
    from draftflow.plan import Plan

    plan = Plan.load(str(recipe), overrides)
    launch = plan.recipe.vllm.launch
    names, prompts, _ = load_eval_prompts(
        plan, load_chat_encoder(plan.recipe.target), limit=None, max_total_tokens=launch.max_model_len
    )
    sides = {name: (folder, None) for name, folder in drafters.items()}
    sides["target alone"] = (plan.target_model, None)
    timed = decode_rounds(
        LaunchServerFactory(launch, log_dir=str(out), side_by_side=True),
        sides,
        prompts,
        plan.recipe.evaluation.max_new_tokens,
        rounds,
        scrape=list(drafters),
        interleave=True,
    )
    target = timed.pop("target alone")
    rows = []
    for name, runs in timed.items():
        info = checkpoint_info(drafters[name])
        pooled = GenerationRun(
            runs[0].outputs, 0.0, [sum(cs[1:], cs[0]) for cs in zip(*(r.per_prompt for r in runs))]
        )
        tau = counters_report(
            pooled, names, drafter=info["kind"], k=info["speculative_tokens"]
        ).mean_acceptance_length
        speed = speed_summary(runs, target)
        differing = sum(a != b for r in runs for a, b in zip(r.outputs, target[0].outputs))
        rows.append({"drafter": name, "tau": tau, **speed, "prompts": len(prompts), "differing": differing})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-window", type=int, default=160, help="self-generated conversations per window")
    ap.add_argument("--speed-rounds", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=24, help="held-out conversations of each window")
    ap.add_argument("--work", type=Path, default=REPO / "draftflow-data" / "bench-refresh")
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    base = [
        f"data.sources=[{{kind: traffic, traffic: {{paths: ['{logs}/*.jsonl'], max_chars: 8000}}}}]",
        f"extraction.store={args.work / 'store'}",
        f"training.run_dir={args.work / 'runs'}",
        f"publish.destination={args.work / 'published'}",
        f"data.eval_samples={args.eval_prompts}",
        *NO_GATE,
    ]
    walls: dict[str, float] = {}
    for window in (1, 2):
        t0 = time.monotonic()
        count = write_traffic(args, window, logs)
        print(f"window {window}: {count} conversations logged in {time.monotonic() - t0:.0f} s", flush=True)
        _, walls[f"extract {window}"] = run(
            [DRAFTFLOW, "extract", str(RECIPE), *sets(base)], args.work / f"extract-{window}.log"
        )
        if window == 1:
            out, walls["train 1"] = run(
                [DRAFTFLOW, "train", str(RECIPE), *sets(base), "--run-id", "window-1"],
                args.work / "train-1.log",
            )
            champion = export_of(out)
            report = args.work / "eval-1"
            run(
                [DRAFTFLOW, "evaluate", champion, "--recipe", str(RECIPE), "--out", str(report), *sets(base)],
                args.work / "evaluate-1.log",
            )
            dest = str(args.work / "published")
            run(
                [DRAFTFLOW, "publish", champion, "--report", str(report / "report.json"), "--to", dest],
                args.work / "publish-1.log",
            )
    out, walls["refresh train"] = run(
        [DRAFTFLOW, "train", str(RECIPE), *sets(base), "--run-id", "refresh", "--init-from", champion],
        args.work / "train-refresh.log",
    )
    refreshed = export_of(out)
    out, walls["full train"] = run(
        [DRAFTFLOW, "train", str(RECIPE), *sets([*base, "refresh.replay=1.0"]), "--run-id", "full"],
        args.work / "train-full.log",
    )
    full = export_of(out)
    drafters = {"champion (window 1)": champion, "refresh (warm + replay)": refreshed, "full retrain": full}
    rows = race(RECIPE, base, drafters, args.speed_rounds, args.work)
    refresh_wall = walls["extract 2"] + walls["refresh train"]
    full_wall = walls["extract 1"] + walls["extract 2"] + walls["full train"]
    print(
        "\n| drafter | prompts | τ vLLM | tok/s with | tok/s target | speed-up | per round | outputs differing |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rounds = " / ".join(f"{x:.2f}x" for x in r["rounds"])
        print(
            f"| {r['drafter']} | {r['prompts']} | {r['tau']:.3f} | {r['with_drafter_tok_s']:.1f} | "
            f"{r['without_drafter_tok_s']:.1f} | {r['speedup']:.2f}x | {rounds} | {r['differing']} |"
        )
    print("\n| run | wall time | of which training |")
    print("|---|---|---|")
    print(
        f"| refresh (window 2 extraction + warm training) | {refresh_wall:.0f} s | {walls['refresh train']:.0f} s |"
    )
    print(f"| full retrain (both extractions + training) | {full_wall:.0f} s | {walls['full train']:.0f} s |")
    tau = {r["drafter"]: r["tau"] for r in rows}
    print(
        f"\nrefresh vs full retrain: τ {tau['refresh (warm + replay)'] - tau['full retrain']:+.3f} at "
        f"{refresh_wall / full_wall:.2f}x the wall time; refresh vs champion: τ "
        f"{tau['refresh (warm + replay)'] - tau['champion (window 1)']:+.3f}"
    )
    (args.work / "refresh-bench.json").write_text(json.dumps({"rows": rows, "walls": walls}, indent=2))


if __name__ == "__main__":
    main()
