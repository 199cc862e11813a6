"""Benchmark: the race a serving team runs before it picks how to speed up decoding in vLLM.

    make bench-race                                                   # everything, from a clean clone
    .venv/bin/python bench/race.py --drafter quality=RUN/export --drafter demo=RUN2/export
    .venv/bin/python bench/race.py --drafter quality=RUN/export --per-category 2 --rounds 1  # a look

Every side serves the same target with the same vLLM build, in one run:

- **target alone**, no speculation;
- **n-gram** (prompt lookup): ``num_speculative_tokens`` 1-4 at ``prompt_lookup_min/max`` 2/4, then
  the best of those at 1/3 and 3/5, each decoded once on the ``draftflow-tune`` prompts between
  passes of the target alone; the fastest goes to the race (tuned on other prompts than it races on);
- **suffix decoding** (arctic-inference, ``scripts/bootstrap.sh --with-suffix``) with vLLM's default
  settings; where the package is not importable in the vLLM virtualenv the table says so;
- each **drafter** given as ``--drafter NAME=EXPORT[@K]`` (``@K``: served with K drafted tokens): the
  quality recipe's and the demo recipe's (trained first when no ``--drafter`` is given), and any
  other export that vLLM serves, the reference trainer's included.

Each round decodes the ``draftflow-eval`` prompts (``--per-category`` of each of its six categories)
on every side back to back, greedy, the side order rotating by prompt and round: first one request
at a time (batch 1), then at each ``--concurrency`` level (groups of N prompts of one category sent
at once). Every pass starts every side's server afresh: a server that has decoded a prompt keeps it
in its prefix cache, and suffix decoding keeps earlier responses in its tree, which would then
draft the repeat word for word. Before each request
or group the bench waits ``PAUSE_S`` untimed, so the side that decoded last has parked its worker.

Per side and concurrency: τ from vLLM's counters (1 + accepted / drafts), completion tokens over
request time pooled over the rounds, the speed-up over the target alone (pooled, and each
round's), the same per category, and how many outputs equal the target's in the same round.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from draftflow.evaluation.speed import rotated_order

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
QUALITY_RECIPE = REPO / "recipes" / "smollm2-135m-dflash-cpu-quality.yaml"
DEMO_RECIPE = REPO / "recipes" / "smollm2-135m-dflash-cpu-demo.yaml"
TARGET, NGRAM, SUFFIX = "target alone", "n-gram", "suffix"
NGRAM_K = (1, 2, 3, 4)
NGRAM_LOOKUP, NGRAM_LOOKUP_TRIED = (2, 4), ((1, 3), (3, 5))
SUFFIX_CONFIG = {"method": "suffix"}  # vLLM's defaults: tree depth 24, adaptive draft length
PAUSE_S = 1.2  # in_vllm.BUSY_POLL_PAUSE_S: a worker spins for 1 s after its last request


@dataclass
class Side:
    name: str
    model: str  # the target, or a drafter's export (vLLM reads its target from the export)
    config: dict | None  # vLLM's --speculative-config
    settings: str = ""  # what the table shows about how it was served


@dataclass
class Group:
    category: str
    names: list[str]
    ids: list[list[int]]


@dataclass
class Decoded:
    """One side's decoding of one group: the outputs, the wall time, the counters' change."""

    category: str
    outputs: dict[str, list[int]]
    seconds: float
    drafts: int = 0
    accepted: int = 0


def ngram_config(k: int, lookup: tuple[int, int]) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": lookup[0],
        "prompt_lookup_max": lookup[1],
    }


def groups_of(names, ids, categories, size: int) -> list[Group]:
    """The prompts in groups of at most ``size``, each within one category, in file order."""
    out: list[Group] = []
    for name, tokens in zip(names, ids):
        cat = categories[name]
        if out and out[-1].category == cat and len(out[-1].names) < size:
            out[-1].names.append(name)
            out[-1].ids.append(tokens)
        else:
            out.append(Group(cat, [name], [tokens]))
    return out


def decode_group(server, group: Group, max_new_tokens: int, scrape: bool) -> Decoded:
    """The group's prompts sent at once (one thread each); counters read before and after."""
    before = server.counters() if scrape else None
    start = time.perf_counter()
    if len(group.ids) == 1:
        results = [server.complete(group.ids[0], max_new_tokens)]
    else:
        with ThreadPoolExecutor(len(group.ids)) as pool:
            results = list(pool.map(lambda p: server.complete(p, max_new_tokens), group.ids))
    seconds = time.perf_counter() - start
    done = Decoded(group.category, {n: r[0] for n, r in zip(group.names, results)}, seconds)
    if before is not None:
        change = server.counters() - before
        done.drafts, done.accepted = change.drafts, change.accepted
    return done


def race(factory, sides: list[Side], passes: dict[str, list[Group]], max_new_tokens: int, rounds: int):
    """{pass: {side: [[Decoded per group] per round]}}: for each round and pass, every side's server
    up at once (fresh ones: a server that has decoded a prompt before has it in its prefix cache, and
    suffix decoding in its response tree), each group decoded on every side back to back, the order
    rotating by group and round."""
    names = [s.name for s in sides]
    scraped = {s.name for s in sides if s.config is not None}  # the target alone has no counters
    out = {p: {n: [] for n in names} for p in passes}
    for r in range(rounds):
        for label, groups in passes.items():
            with ExitStack() as stack:
                servers = {side.name: _started(stack, factory, side, groups[0].ids[0]) for side in sides}
                for n in names:
                    out[label][n].append([])
                for g, group in enumerate(groups):
                    for n in rotated_order(names, 1, first_round=r + g):
                        time.sleep(PAUSE_S)
                        out[label][n][-1].append(
                            decode_group(servers[n], group, max_new_tokens, n in scraped)
                        )
        print(f"round {r + 1}/{rounds} done", flush=True)
    return out


def _started(stack: ExitStack, factory, side: Side, warm_prompt: list[int]):
    from draftflow.evaluation.in_vllm import _Server

    server = _Server(stack.enter_context(factory(side.model, side.config)), 600.0)
    stack.callback(server.close)
    server.complete(warm_prompt, 8)  # warm-up, before any counter is read
    return server


def _tok_s(decoded: list[Decoded]) -> float:
    return sum(len(o) for d in decoded for o in d.outputs.values()) / sum(d.seconds for d in decoded)


def summarise(results: dict[str, list[list[Decoded]]]) -> dict[str, dict]:
    """Per side: tok/s, speed-up (pooled and per round), τ, per category, identical outputs."""
    target = results[TARGET]
    target_flat = [d for rnd in target for d in rnd]
    t_tok_s = _tok_s(target_flat)
    rows = {}
    for name, rounds in results.items():
        flat = [d for rnd in rounds for d in rnd]
        tok_s = _tok_s(flat)
        drafts, accepted = sum(d.drafts for d in flat), sum(d.accepted for d in flat)
        same = sum(
            out == t_out
            for rnd, t_rnd in zip(rounds, target)
            for d, t in zip(rnd, t_rnd)
            for out, t_out in zip(d.outputs.values(), t.outputs.values())
        )
        per_round = [_tok_s(rnd) / _tok_s(t_rnd) for rnd, t_rnd in zip(rounds, target)]
        cats = {}
        for cat in dict.fromkeys(d.category for d in flat):
            mine = [d for d in flat if d.category == cat]
            theirs = [d for d in target_flat if d.category == cat]
            d_cat, a_cat = sum(d.drafts for d in mine), sum(d.accepted for d in mine)
            cats[cat] = {
                "tau": 1 + a_cat / d_cat if d_cat else None,
                "speedup": _tok_s(mine) / _tok_s(theirs),
            }
        rows[name] = {
            "tok_s": tok_s,
            "speedup": tok_s / t_tok_s,
            "speedup_rounds": per_round,
            "tau": 1 + accepted / drafts if drafts else None,
            "drafts": drafts,
            "per_category": cats,
            "outputs": sum(len(d.outputs) for d in flat),
            "identical": same,
        }
    return rows


def tune_ngram(factory, target: str, names, ids, max_new_tokens: int) -> tuple[dict, list[dict]]:
    """The fastest n-gram setting on the tuning prompts: k at the default lookup, then the best k at
    the other lookups; each one pass on a fresh server, the target alone before, between and after."""
    from draftflow.evaluation.in_vllm import decode_rounds

    def one(config):
        return decode_rounds(factory, {"side": (target, config)}, ids, max_new_tokens, 1)["side"][
            0
        ].tokens_per_s

    baseline = [one(None)]
    tried = []
    for config in (ngram_config(k, NGRAM_LOOKUP) for k in NGRAM_K):
        tried.append({"config": config, "tok_s": one(config)})
    baseline.append(one(None))
    best_k = max(tried, key=lambda t: t["tok_s"])["config"]["num_speculative_tokens"]
    for config in (ngram_config(best_k, lookup) for lookup in NGRAM_LOOKUP_TRIED):
        tried.append({"config": config, "tok_s": one(config)})
    baseline.append(one(None))
    target_tok_s = sum(baseline) / len(baseline)
    for t in tried:
        t["speedup"] = t["tok_s"] / target_tok_s
    best = max(tried, key=lambda t: t["tok_s"])
    print(f"n-gram tuning ({len(names)} prompts, target alone {baseline} tok/s): best {best}", flush=True)
    return best["config"], tried + [{"config": None, "tok_s": target_tok_s, "passes": baseline}]


def drafter_spec(spec: str) -> tuple[str, str, int | None]:
    """``NAME=EXPORT[@K]`` → (name, absolute export path, K or None)."""
    found = re.fullmatch(r"([^=]+)=(.+?)(?:@(\d+))?", spec)
    if not found:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=EXPORT or NAME=EXPORT@K")
    return found[1], str(Path(found[2]).resolve()), int(found[3]) if found[3] else None


def settings_text(config: dict | None) -> str:
    if not config:
        return ""
    return ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("method", "model"))


def markdown(summary: dict, sides: list[Side], unavailable: dict[str, str]) -> list[str]:
    lines = []
    for label, rows in summary.items():
        cats = list(next(iter(rows.values()))["per_category"])
        lines += [f"**{label}**", "", "| side | settings | τ | tok/s | speed-up | rounds | identical |"]
        lines.append("|---|---|---|---|---|---|---|")
        for side in sides:
            r = rows[side.name]
            tau = f"{r['tau']:.2f}" if r["tau"] else "—"
            spread = " / ".join(f"{x:.2f}" for x in r["speedup_rounds"])
            lines.append(
                f"| {side.name} | {side.settings} | {tau} | {r['tok_s']:.1f} | **{r['speedup']:.2f}x** "
                f"| {spread} | {r['identical']}/{r['outputs']} |"
            )
        for name, why in unavailable.items():
            lines.append(f"| {name} | not run: {why} | | | | | |")
        lines += ["", "τ / speed-up per category:", ""]
        lines.append("| side | " + " | ".join(cats) + " |")
        lines.append("|---|" + "---|" * len(cats))
        for side in sides:
            cells = []
            for c in cats:
                v = rows[side.name]["per_category"][c]
                cells.append((f"{v['tau']:.2f} / " if v["tau"] else "") + f"{v['speedup']:.2f}x")
            lines.append(f"| {side.name} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=QUALITY_RECIPE, help="the target and vllm.launch")
    ap.add_argument("--drafter", action="append", type=drafter_spec, default=[], metavar="NAME=EXPORT[@K]")
    ap.add_argument("--per-category", type=int, default=13, help="draftflow-eval prompts per category")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[4], help="levels besides batch 1")
    ap.add_argument("--ngram", help="race this n-gram setting (K,MIN,MAX) instead of tuning one")
    ap.add_argument("--out", type=Path, default=REPO / "draftflow-data" / "bench-race")
    return ap.parse_args()


def trained_drafters(out: Path) -> list[tuple[str, str, None]]:
    """No --drafter: the quality and the demo recipes' pipelines, then their exports."""
    from quality import train

    return [
        (name, train(recipe, [], out / f"pipeline-{name}.log")[0], None)
        for name, recipe in (("quality recipe", QUALITY_RECIPE), ("demo recipe", DEMO_RECIPE))
    ]


def main() -> None:
    from draftflow.data.chat import load_chat_encoder
    from draftflow.evaluation.baselines import BaselineUnavailable, check_available
    from draftflow.evaluation.in_vllm import LaunchServerFactory
    from draftflow.evaluation.run import load_prompt_set
    from draftflow.models import checkpoint_info
    from draftflow.plan import Plan
    from draftflow.recipe.load import expand

    args = parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    drafters = args.drafter or trained_drafters(args.out)
    plan = Plan.load(
        str(args.recipe.resolve()),
        ["evaluation.prompt_set=draftflow-eval", f"evaluation.prompts_per_category={args.per_category}"],
    )
    launch = plan.recipe.vllm.launch
    if launch is None:
        raise SystemExit(f"{args.recipe}: the race starts its own servers: the recipe needs vllm.launch")
    target = expand(plan.recipe.target.model)
    for name, export, _ in drafters:
        verifier = checkpoint_info(export)["verifier"]
        if Path(expand(verifier)).resolve() != Path(target).resolve():
            raise SystemExit(f"--drafter {name}: drafts for {verifier}, not the recipe's target {target}")
    encoder = load_chat_encoder(plan.recipe.target)
    max_new = plan.recipe.evaluation.max_new_tokens
    names, ids, _, categories = load_prompt_set(plan, encoder, max_total_tokens=launch.max_model_len)
    tune = [(p.prompt_id, encoder.prompt_ids(p.messages)) for p in _tuning_prompts()]
    factory = LaunchServerFactory(launch, log_dir=args.out)
    started = time.monotonic()

    if args.ngram:
        k, low, high = (int(x) for x in args.ngram.split(","))
        best, tuning = ngram_config(k, (low, high)), []
    else:
        best, tuning = tune_ngram(factory, target, [n for n, _ in tune], [i for _, i in tune], max_new)
    sides = [Side(TARGET, target, None), Side(NGRAM, target, best, settings_text(best))]
    unavailable = {}
    try:
        check_available([SUFFIX], expand(launch.python), launch.env)
        sides.append(Side(SUFFIX, target, SUFFIX_CONFIG, "vLLM defaults"))
    except BaselineUnavailable:
        unavailable[SUFFIX] = (
            f"arctic_inference is not importable by {expand(launch.python)} "
            "(`scripts/bootstrap.sh --with-suffix` builds it there)"
        )
    for name, export, k in drafters:
        served = k or checkpoint_info(export)["speculative_tokens"]
        sides.append(Side(name, export, {"num_speculative_tokens": served}, f"k={served}"))

    passes = {"batch 1": groups_of(names, ids, categories, 1)}
    for level in args.concurrency:
        passes[f"concurrency {level}"] = groups_of(names, ids, categories, level)
    side_factory = LaunchServerFactory(launch, log_dir=args.out, side_by_side=True)
    decoded = race(side_factory, sides, passes, max_new, args.rounds)
    summary = {label: summarise(results) for label, results in decoded.items()}
    lines = markdown(summary, sides, unavailable)
    report = {
        "recipe": str(args.recipe),
        "prompts": len(names),
        "per_category": args.per_category,
        "rounds": args.rounds,
        "max_new_tokens": max_new,
        "sides": [{"name": s.name, "model": s.model, "config": s.config} for s in sides],
        "unavailable": unavailable,
        "ngram_tuning": tuning,
        "summary": summary,
        "seconds": time.monotonic() - started,
    }
    (args.out / "race.json").write_text(json.dumps(report, indent=1))
    (args.out / "race.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{len(names)} prompts, {args.rounds} rounds, {report['seconds'] / 60:.1f} min; {args.out}/race.md")


def _tuning_prompts():
    from draftflow.evaluation.categories import load_prompt_set

    return load_prompt_set("draftflow-tune")


if __name__ == "__main__":
    main()
