"""The progress helper shared by the CLI and the Prefect tasks (core, no Prefect)."""

from __future__ import annotations

import asyncio
import io

from draftflow.async_run import run_coroutine
from draftflow.data.regenerate import regenerate_conversations
from draftflow.progress import LineSink, Progress, RichBar, reporting, stage


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_say_done_total_rate_eta_and_failures_and_are_throttled():
    clock, lines = Clock(), []
    progress = Progress(
        "extraction", 10, unit="samples", sinks=[LineSink(lines.append)], interval_s=5.0, clock=clock
    )
    clock.now += 2.0
    progress.advance(2)  # first update: always shown
    clock.now += 1.0
    progress.advance(1, failed=1)  # within 5 s of the last line: not shown
    clock.now += 5.0
    progress.advance(1)
    assert lines == [
        "extraction: 2/10 samples (20.0%), 1.00 samples/s, ETA 0:00:08, 0 failed",
        "extraction: 4/10 samples (40.0%), 0.50 samples/s, ETA 0:00:12, 1 failed",
    ]
    progress.update(done=10)  # complete: shown at once
    assert lines[-1].startswith("extraction: 10/10 samples (100.0%)")
    snap = progress.close()
    assert lines[-1].endswith("done, 1 failed") and snap.finished and snap.eta_s == 0.0
    progress.close()  # closing twice reports once
    assert len(lines) == 4


def test_stages_report_to_the_innermost_reporting_block_also_from_tasks_and_threads():
    seen: list[str] = []

    async def work():
        p = stage("inner", 2, interval_s=0.0)
        await asyncio.gather(*(asyncio.to_thread(p.advance) for _ in range(2)))
        p.close()

    with reporting(LineSink(seen.append)):
        run_coroutine(work())

        async def nested():  # run_coroutine from a running loop: its own thread, same sinks
            run_coroutine(work())

        asyncio.run(nested())
    run_coroutine(work())  # outside any reporting block: silent
    assert len([s for s in seen if s.startswith("inner: 2/2")]) == 4 and len(seen) == 6


def test_regeneration_counts_conversations_and_failures():
    seen: list[str] = []

    async def generate(messages, max_tokens):
        if "fail" in messages[-1]["content"]:
            raise RuntimeError("server said no")
        return "a reply"

    conversations = [
        [{"role": "user", "content": c}, {"role": "assistant", "content": "x"}]
        for c in ("hi", "fail please", "hello")
    ]
    with reporting(LineSink(seen.append)):
        results, _ = run_coroutine(regenerate_conversations(conversations, generate, 8, 2))
    assert [r[1] for r in results] == [None, "regenerate_failed", None]
    assert seen[-1].startswith("regenerating replies: 3/3 conversations (100.0%)") and seen[-1].endswith(
        "done, 1 failed"
    )


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rich_bar_on_a_terminal_and_plain_lines_in_a_log():
    term = Terminal()
    with Progress("training", 4, unit="steps", sinks=[RichBar(term)], interval_s=0.0) as p:
        for _ in range(3):
            p.advance()
        p.advance(failed=1)
    out = term.getvalue()
    assert "training" in out and "4/4" in out and "1 failed" in out and "steps/s" in out
    log = io.StringIO()
    with Progress("training", 2, unit="steps", sinks=[RichBar(log)], interval_s=0.0) as p:
        p.advance(2)
    assert log.getvalue().splitlines()[0].startswith("training: 2/2 steps (100.0%)")
