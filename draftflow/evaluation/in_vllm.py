"""Acceptance measured by vLLM itself: the target served with the checkpoint as its drafter.

The checkpoint folder is passed as ``--model``: vLLM serves the verifier named in its
config.json with the folder as the speculative model (the API model id is the folder path).
Prompts go as token ids to ``/v1/completions``, one at a time, greedy, ``max_tokens =
max_new_tokens``. Acceptance comes from the spec-decode Prometheus counters on ``/metrics``,
scraped before and after every prompt (cumulative counters; ``_created`` samples ignored;
summed over label sets):

    vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
    vllm:spec_decode_num_accepted_tokens_total,
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}

Then the plain target is served with the same settings (a second server, started after the
first stopped) on the same prompts: generation throughput with and without the drafter (sum of
completion tokens / sum of request latencies, batch size 1, after one warm-up request) and a
lossless check (outputs with the drafter vs without). Train-free baselines that the drafter must
beat (``evaluation.must_beat``: n-gram, suffix decoding) are more sides of the same rounds, the
target served with their ``--speculative-config`` (speed and its table: :mod:`.speed`).

Servers come from a *server factory*: ``factory(model, speculative_config) -> context manager
yielding the base URL``. :class:`LaunchServerFactory` starts and stops a server per use;
:func:`reusing_factory` wraps a pool that keeps servers running (the tests' fixture).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from draftflow.evaluation.baselines import baseline_configs
from draftflow.evaluation.report import AcceptanceReport, PromptAcceptance
from draftflow.evaluation.speed import (  # noqa: F401  (pooled_tokens_per_s and rotated_order re-exported)
    CHAMPION,
    DRAFTER,
    TARGET,
    GenerationRun,
    baseline_summary,
    first_difference,
    later_round_differences,
    pooled_tokens_per_s,
    prompt_timings,
    rotated_order,
    speed_summary,
)
from draftflow.models import checkpoint_info
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port

ServerFactory = Callable[[str, dict | None], AbstractContextManager[str]]

_PREFIX = "vllm:spec_decode_"
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_POSITION = re.compile(r'position="(\d+)"')


class SpecDecodeMetricsMissing(RuntimeError):
    """The server exposes no spec-decode counters: it runs no drafter."""


@dataclass(frozen=True)
class SpecCounters:
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: dict[int, int]

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        positions = set(self.accepted_per_position) | set(other.accepted_per_position)
        return SpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            {
                p: self.accepted_per_position.get(p, 0) + sign * other.accepted_per_position.get(p, 0)
                for p in positions
            },
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, -1)

    def per_position(self, k: int) -> list[int]:
        return [self.accepted_per_position.get(i, 0) for i in range(k)]


def parse_spec_counters(text: str) -> SpecCounters:
    """The spec-decode counters in a Prometheus text exposition, summed over label sets."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    found = False
    for line in text.splitlines():
        if not line.startswith(_PREFIX):
            continue
        m = _SAMPLE.match(line)
        if not m or not m["name"].endswith("_total"):  # skips the `_created` timestamps
            continue
        found = True
        base, value = m["name"][len(_PREFIX) : -len("_total")], float(m["value"])
        if base == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(m["labels"] or "")
            if pos:
                per_pos[int(pos[1])] = per_pos.get(int(pos[1]), 0.0) + value
        elif base in totals:
            totals[base] += value
    if not found:
        raise SpecDecodeMetricsMissing(
            "no vllm:spec_decode_* counters on /metrics: the server runs no drafter"
        )
    return SpecCounters(
        round(totals["num_drafts"]),
        round(totals["num_draft_tokens"]),
        round(totals["num_accepted_tokens"]),
        {p: round(v) for p, v in per_pos.items()},
    )


# ---------------------------------------------------------------------------------------
# Server factories
# ---------------------------------------------------------------------------------------


class LaunchServerFactory:
    """Starts one vLLM server per use with a recipe's ``vllm.launch`` settings and stops it
    afterwards; fp32 on CPU unless ``dtype`` says otherwise (the simulator it is compared with runs fp32).
    ``host_lock=False``: no server takes the CPU host lock (see ServerProcess). ``side_by_side``:
    servers may run at once; the first takes the host lock and those started while it runs go
    without (other processes still wait for it), so it must stop last: nested ``with`` blocks,
    or one ExitStack, do that."""

    def __init__(
        self,
        launch: VLLMLaunchSection,
        *,
        dtype: str | None = None,
        log_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        host_lock: bool = True,
        side_by_side: bool = False,
    ):
        self.launch, self.log_dir, self.host, self.host_lock = launch, log_dir, host, host_lock
        self.side_by_side = side_by_side
        self.dtype = dtype or ("float32" if launch.device == "cpu" else "auto")
        self._running = 0

    @contextmanager
    def __call__(self, model: str, speculative_config: dict | None = None) -> Iterator[str]:
        port = free_port()
        log = str(Path(self.log_dir) / f"vllm-eval-{port}.log") if self.log_dir else None
        spec = LaunchSpec.from_section(
            self.launch,
            model=str(model),
            port=port,
            host=self.host,
            dtype=self.dtype,
            speculative_config=speculative_config,
            log_path=log,
        )
        covered = self.side_by_side and self._running > 0  # by the lock the first server holds
        server = ServerProcess(spec, host_lock=self.host_lock and not covered).start()
        self._running += 1
        try:
            server.wait_healthy(self.launch.startup_timeout_s)
            yield server.url
        finally:
            server.stop()
            self._running -= 1


def reusing_factory(get: Callable[..., Any], **settings) -> ServerFactory:
    """A factory over a pool that keeps servers running: ``get(model, **LaunchSpec fields)``
    returns a running server (with ``.url``) and stops the previous one itself."""

    @contextmanager
    def factory(model: str, speculative_config: dict | None = None) -> Iterator[str]:
        extra = {"speculative_config": speculative_config} if speculative_config else {}
        yield get(str(model), **settings, **extra).url

    return factory


# ---------------------------------------------------------------------------------------
# The evaluator
# ---------------------------------------------------------------------------------------


@dataclass
class VLLMResult:
    report: AcceptanceReport
    outputs: list[list[int]]  # generated token ids per prompt, with the drafter
    baseline_outputs: list[list[int]] | None  # without the drafter (None: not measured)


class _Server:
    """Sequential greedy completions and metric scrapes against one server."""

    def __init__(self, url: str, timeout_s: float):
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.model = self.http.get(f"{self.url}/v1/models").raise_for_status().json()["data"][0]["id"]

    def complete(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        payload = {
            "model": self.model,
            "prompt": [int(t) for t in prompt],
            "max_tokens": int(max_tokens),
            "temperature": 0.0,
            "return_token_ids": True,
        }
        start = time.perf_counter()
        response = self.http.post(f"{self.url}/v1/completions", json=payload)
        elapsed = time.perf_counter() - start
        if response.status_code >= 400:
            raise RuntimeError(
                f"{self.url}/v1/completions: HTTP {response.status_code}: {response.text[:500]}"
            )
        choice = response.json()["choices"][0]
        if choice.get("token_ids") is None:
            raise RuntimeError(
                f"{self.url}: the completion carries no token_ids (vLLM too old for return_token_ids?)"
            )
        return [int(t) for t in choice["token_ids"]], elapsed

    def counters(self, settle_s: float = 2.0) -> SpecCounters:
        """The counters, read until two reads agree (they are recorded as outputs are processed)."""
        last = parse_spec_counters(self.http.get(f"{self.url}/metrics").raise_for_status().text)
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = parse_spec_counters(self.http.get(f"{self.url}/metrics").raise_for_status().text)
            if now == last:
                return now
            last = now
        return last

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, scrape: bool) -> GenerationRun:
        timed = _Pass(self, prompts[0], max_tokens, scrape=scrape)
        for prompt in prompts:
            timed.decode(prompt)
        return timed.run()

    def close(self) -> None:
        self.http.close()


class _Pass:
    """One side's timed pass over the prompts on one server, its counters read between requests."""

    def __init__(self, server: _Server, warm_prompt: Sequence[int], max_tokens: int, *, scrape: bool):
        server.complete(warm_prompt, min(8, max_tokens))  # warm-up, before any counter is read
        self.server, self.max_tokens = server, max_tokens
        self.before = server.counters() if scrape else None
        self.outputs: list[list[int]] = []
        self.seconds = 0.0
        self.prompt_seconds: list[float] = []
        self.per_prompt: list[SpecCounters] = []

    def decode(self, prompt: Sequence[int]) -> None:
        tokens, elapsed = self.server.complete(prompt, self.max_tokens)
        self.outputs.append(tokens)
        self.seconds += elapsed
        self.prompt_seconds.append(elapsed)
        if self.before is not None:
            after = self.server.counters()
            self.per_prompt.append(after - self.before)
            self.before = after

    def run(self) -> GenerationRun:
        per_prompt = self.per_prompt if self.before is not None else None
        return GenerationRun(self.outputs, self.seconds, per_prompt, self.prompt_seconds)


def _generate(
    factory: ServerFactory,
    model: str,
    speculative_config: dict | None,
    prompts,
    max_tokens: int,
    scrape: bool,
    timeout_s: float,
) -> GenerationRun:
    with factory(model, speculative_config) as url:
        server = _Server(url, timeout_s)
        try:
            return server.generate(prompts, max_tokens, scrape=scrape)
        finally:
            server.close()


def evaluate_in_vllm(
    checkpoint_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    server_factory: ServerFactory,
    prompt_names: Sequence[str] | None = None,
    speculative_config: dict | None = None,
    measure_baseline: bool = True,
    speed_rounds: int = 1,
    interleave: bool = False,
    baselines: Sequence[str] = (),
    champion: tuple[str, str] | None = None,
    request_timeout_s: float = 600.0,
) -> VLLMResult:
    """Serve the target with ``checkpoint_dir`` as its drafter and read vLLM's own acceptance.

    speculative_config: extra ``--speculative-config`` JSON merged in by vLLM (e.g.
    ``{"num_speculative_tokens": 5}``). measure_baseline: also serve the plain target (the
    verifier in config.json) for throughput and the lossless check. speed_rounds: with
    measure_baseline, decode the prompts this many times on each side (see :func:`rotated_order`).
    interleave: with measure_baseline, time the sides with :func:`decode_rounds`'s interleaved
    schedule (the factory must allow every side's server at once); the counters come from its first
    round. baselines: with measure_baseline, train-free speculation on the target
    (:mod:`draftflow.evaluation.baselines`, drafting the drafter's k tokens) decoded as more sides
    of the same rounds; each one's speed lands in ``throughput["baselines"]``. champion: with
    measure_baseline, (version, folder) of the drafter in service, decoded as one more side with its
    counters read: its τ and speed land in ``throughput["champion"]``.
    """
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if (interleave or baselines or champion) and not measure_baseline:
        raise ValueError(
            "an interleaved schedule and baselines are timed against the target alone: needs measure_baseline"
        )
    names = list(prompt_names) if prompt_names is not None else [str(i) for i in range(len(prompts))]
    info = checkpoint_info(checkpoint_dir)
    k = int((speculative_config or {}).get("num_speculative_tokens") or info["speculative_tokens"])
    configs = baseline_configs(list(baselines), k)
    sides = {DRAFTER: (str(checkpoint_dir), speculative_config), TARGET: (info["verifier"], None)}
    sides.update({name: (info["verifier"], config) for name, config in configs.items()})
    scrape = [DRAFTER]
    if champion is not None:
        sides[CHAMPION] = (champion[1], speculative_config)
        scrape.append(CHAMPION)
    rounds = (server_factory, sides, prompts, max_new_tokens, speed_rounds, request_timeout_s)
    timed = decode_rounds(*rounds, scrape=scrape, interleave=True) if interleave else None
    if timed:
        run = timed[DRAFTER][0]
    else:
        run = _generate(server_factory, *sides[DRAFTER], prompts, max_new_tokens, True, request_timeout_s)
    report = counters_report(run, names, drafter=info["kind"], k=k, max_new_tokens=max_new_tokens)
    report.notes.insert(0, f"vLLM spec-decode counters; target {info['verifier']}")
    baseline = None
    if measure_baseline:
        timed = timed or decode_rounds(*rounds, first=run, scrape=scrape[1:])
        baseline = timed[TARGET][0].outputs
        report.throughput = dict(
            speed_summary(timed[DRAFTER], timed[TARGET]),
            schedule="interleaved" if interleave else "rotated",
        )
        same = [a == b for a, b in zip(run.outputs, baseline)]
        report.outputs_identical = sum(same)
        report.notes += [
            f"prompt {n}: output with the drafter differs from the target alone (first at token "
            f"{first_difference(a, b)})"
            for n, ok, a, b in zip(names, same, run.outputs, baseline)
            if not ok
        ]
        report.notes += later_round_differences(timed[DRAFTER][1:], timed[TARGET][1:], baseline)
        if configs:
            report.throughput["baselines"] = {}
            for name, config in configs.items():
                summary, notes = baseline_summary(name, config, timed[name], timed[TARGET], names)
                report.throughput["baselines"][name] = summary
                report.notes += notes
        if champion is not None:
            report.throughput[CHAMPION] = champion_summary(champion, timed, names, speculative_config)
            report.notes += report.throughput[CHAMPION].pop("notes")
        report.throughput["prompt_timings"] = prompt_timings(timed, names)
    return VLLMResult(report, run.outputs, baseline)


def champion_summary(
    champion: tuple[str, str],
    timed: dict[str, list[GenerationRun]],
    names: Sequence[str],
    speculative_config: dict | None,
) -> dict:
    """The champion side: its version, τ from its first pass's counters, its speed as a baseline's
    (speed-up over the same target passes) and, under ``notes``, where its outputs differ."""
    version, folder = champion
    info = checkpoint_info(folder)
    runs = timed[CHAMPION]
    k = int((speculative_config or {}).get("num_speculative_tokens") or info["speculative_tokens"])
    tau = counters_report(runs[0], names, drafter=info["kind"], k=k).mean_acceptance_length
    summary, notes = baseline_summary(CHAMPION, {"version": version}, runs, timed[TARGET], names)
    return {"version": version, "tau": tau, **summary, "notes": notes}


def counters_report(
    run: GenerationRun, names: Sequence[str], *, drafter: str, k: int, max_new_tokens: int | None = None
) -> AcceptanceReport:
    """The vLLM :class:`AcceptanceReport` of a pass whose counters were scraped per prompt."""
    per_prompt = [
        PromptAcceptance(name, c.drafts, c.accepted, len(out), c.draft_tokens, c.per_position(k))
        for name, c, out in zip(names, run.per_prompt, run.outputs)
    ]
    total = sum(run.per_prompt[1:], run.per_prompt[0])
    report = AcceptanceReport(
        source="vllm",
        drafter=drafter,
        draft_length=k,
        num_prompts=len(run.outputs),
        drafts=total.drafts,
        draft_tokens=total.draft_tokens,
        accepted_tokens=total.accepted,
        accepted_per_position=total.per_position(k),
        per_prompt=per_prompt,
        max_new_tokens=max_new_tokens,
    )
    extra = [p for p in total.accepted_per_position if p >= k and total.accepted_per_position[p]]
    if extra:
        report.notes.append(f"counters report accepted positions {extra} beyond the draft length {k}")
    return report


# vLLM's worker spins on its shared-memory queue for 1 s after its last read before it parks;
# a server that has just decoded would otherwise take cores from the next one.
BUSY_POLL_PAUSE_S = 1.2


def decode_rounds(
    factory: ServerFactory,
    sides: dict[str, tuple[str, dict | None]],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    rounds: int,
    request_timeout_s: float = 600.0,
    *,
    first: GenerationRun | None = None,
    scrape: Sequence[str] = (),
    interleave: bool = False,
    pause_s: float = BUSY_POLL_PAUSE_S,
) -> dict[str, list[GenerationRun]]:
    """Decode ``prompts`` ``rounds`` times on each side ({name: (model, speculative config)}), a
    fresh server per pass, in :func:`rotated_order`. ``first``: the first pass, already run (the
    evaluator's counter-scraping pass). ``scrape``: sides whose spec-decode counters are read per
    prompt (outside the timed requests).

    ``interleave``: every side's server runs at once (fresh ones each round, started one after
    another) and each prompt is decoded on every side back to back, the order rotating by prompt
    and round. A host whose speed drifts over minutes then slows every side alike, where passes
    minutes apart can fall on a fast and a slow stretch. Each request waits ``pause_s`` untimed
    first (see BUSY_POLL_PAUSE_S). The factory must allow servers side by side
    (``LaunchServerFactory(..., side_by_side=True)``)."""
    if interleave:
        if first is not None:
            raise ValueError("an interleaved round decodes every side at once: it cannot reuse a first pass")
        return _interleaved_rounds(
            factory, sides, prompts, max_new_tokens, rounds, request_timeout_s, scrape, pause_s
        )
    timed: dict[str, list[GenerationRun]] = {name: [] for name in sides}
    for i, name in enumerate(rotated_order(list(sides), rounds)):
        if i == 0 and first is not None:
            timed[name].append(first)
            continue
        model, config = sides[name]
        timed[name].append(
            _generate(factory, model, config, prompts, max_new_tokens, name in scrape, request_timeout_s)
        )
    return timed


def _interleaved_rounds(factory, sides, prompts, max_new_tokens, rounds, request_timeout_s, scrape, pause_s):
    names = list(sides)
    timed: dict[str, list[GenerationRun]] = {name: [] for name in names}
    for r in range(rounds):
        with ExitStack() as stack:
            passes = {}
            for name in names:
                model, config = sides[name]
                server = _Server(stack.enter_context(factory(model, config)), request_timeout_s)
                stack.callback(server.close)
                passes[name] = _Pass(server, prompts[0], max_new_tokens, scrape=name in scrape)
            for i, prompt in enumerate(prompts):
                for name in rotated_order(names, 1, first_round=r + i):
                    time.sleep(pause_s)
                    passes[name].decode(prompt)
            for name in names:
                timed[name].append(passes[name].run())
    return timed
