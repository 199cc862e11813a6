"""Progress of long work (prompt generation, regeneration, extraction, training), one helper for all.

A :class:`Progress` counts done / total / failed for one stage and derives the rate and the
ETA; it forwards a :class:`ProgressSnapshot` to its sinks, at most every ``interval_s``
seconds (and always at the first and the last item):

- :class:`RichBar`: a ``rich`` progress bar on a terminal (the CLI);
- :class:`LineSink`: one plain line per update through any callable, e.g. ``print``, a
  logger's ``info``, or a Prefect task that also updates a progress artifact (``tasks/``).

The core never imports Prefect; tasks pass their logger and artifact calls in as sinks. Code
deep in the core (regeneration, extraction) does not take sinks as arguments: it opens
:func:`stage`, which reports to the sinks of the innermost :func:`reporting` block of the
caller (a context variable: it follows asyncio tasks and ``asyncio.to_thread``), and to
nothing outside one.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class ProgressSnapshot:
    label: str
    done: int
    total: int | None
    failed: int
    elapsed_s: float
    unit: str = "items"
    finished: bool = False

    @property
    def rate(self) -> float:
        """Items finished (ok or failed) per second since the start."""
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.done / self.total) if self.total else None

    @property
    def eta_s(self) -> float | None:
        if not self.total or self.rate <= 0:
            return None
        return max(0.0, (self.total - self.done) / self.rate)

    def line(self) -> str:
        """e.g. ``extraction: 120/216 samples (55.6%), 3.20 samples/s, ETA 0:00:30, 2 failed``."""
        total = f"/{self.total}" if self.total is not None else ""
        pct = f" ({100 * self.fraction:.1f}%)" if self.fraction is not None else ""
        eta = "done" if self.finished else f"ETA {format_duration(self.eta_s)}"
        return (
            f"{self.label}: {self.done}{total} {self.unit}{pct}, {self.rate:.2f} {self.unit}/s, "
            f"{eta}, {self.failed} failed"
        )

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "done": self.done,
            "total": self.total,
            "failed": self.failed,
            "unit": self.unit,
            "rate_per_s": self.rate,
            "eta_s": self.eta_s,
            "elapsed_s": self.elapsed_s,
            "finished": self.finished,
        }


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


Sink = Callable[[ProgressSnapshot], None]


class Progress:
    """Thread-safe counters for one stage; see the module doc."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        unit: str = "items",
        sinks: Sequence[Sink] = (),
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.sinks = list(sinks)
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self.done = self.failed = 0
        self._last_emit: float | None = None
        self._closed = False
        self._lock = threading.Lock()

    def snapshot(self, finished: bool = False) -> ProgressSnapshot:
        return ProgressSnapshot(
            self.label, self.done, self.total, self.failed, self.clock() - self.started, self.unit, finished
        )

    def advance(self, n: int = 1, *, failed: int = 0) -> None:
        """``n`` more items finished, ``failed`` of them failed."""
        with self._lock:
            self.done += n
            self.failed += failed
            self._maybe_emit()

    def update(self, *, done: int | None = None, total: int | None = None, failed: int | None = None) -> None:
        """Set absolute counts (when the worker reports totals, e.g. a trainer's step)."""
        with self._lock:
            if done is not None:
                self.done = done
            if total is not None:
                self.total = total
            if failed is not None:
                self.failed = failed
            self._maybe_emit()

    def close(self) -> ProgressSnapshot:
        with self._lock:
            snap = self.snapshot(finished=True)
            if not self._closed:
                self._closed = True
                self._emit(snap)
            return snap

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _maybe_emit(self) -> None:
        now = self.clock()
        complete = self.total is not None and self.done >= self.total
        if self._last_emit is None or complete or now - self._last_emit >= self.interval_s:
            self._emit(self.snapshot())

    def _emit(self, snap: ProgressSnapshot) -> None:
        self._last_emit = self.clock()
        for sink in self.sinks:
            sink(snap)


class LineSink:
    """One line per emitted snapshot through ``write`` (print, logger.info, ...); an optional
    ``also`` receives the snapshot itself (a progress artifact)."""

    def __init__(self, write: Callable[[str], object], also: Sink | None = None):
        self.write, self.also = write, also

    def __call__(self, snap: ProgressSnapshot) -> None:
        self.write(snap.line())
        if self.also is not None:
            self.also(snap)


class RichBar:
    """A ``rich`` progress bar (done/total, rate, ETA, failures) on a terminal; plain lines
    (every ``interval_s`` of the owning :class:`Progress`) when the stream is not one."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self._bar = None
        self._task = None
        self._plain = LineSink(lambda text: print(text, file=self.stream, flush=True))

    def __call__(self, snap: ProgressSnapshot) -> None:
        if not self.stream.isatty():
            self._plain(snap)
            return
        if self._bar is None:
            self._start(snap)
        self._bar.update(
            self._task,
            completed=snap.done,
            total=snap.total,
            failed=snap.failed,
            rate=f"{snap.rate:.2f} {snap.unit}/s",
        )
        if snap.finished:
            self._bar.stop()
            self._bar = None

    def _start(self, snap: ProgressSnapshot) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(snap.unit),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[failed]} failed"),
            console=Console(file=self.stream),
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(snap.label, total=snap.total, failed=0, rate="")


_SINKS: contextvars.ContextVar[tuple[Sink, ...]] = contextvars.ContextVar(
    "draftflow_progress_sinks", default=()
)


@contextlib.contextmanager
def reporting(*sinks: Sink) -> Iterator[None]:
    """Stages opened inside report to ``sinks`` (see the module doc)."""
    token = _SINKS.set(tuple(sinks))
    try:
        yield
    finally:
        _SINKS.reset(token)


def stage(label: str, total: int | None = None, *, unit: str = "items", interval_s: float = 5.0) -> Progress:
    """A :class:`Progress` reporting to the current :func:`reporting` sinks (none: silent)."""
    return Progress(label, total, unit=unit, sinks=_SINKS.get(), interval_s=interval_s)
