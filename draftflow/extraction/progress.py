"""Progress events and the final summary of an extraction run (what the CLI bar and logs show)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a runtime import would be circular (run imports this module and shards)
    from draftflow.extraction.shards import ShardResult
    from draftflow.store import Reconciliation

_FAILURES_KEPT = 20  # a summary names the first few failures; the manifest has them all


@dataclass(frozen=True)
class ExtractionProgress:
    """One progress event.

    ``stage``: server, prepare, reconcile, extract, done. ``event``: "stage" when a stage
    begins (``message`` says what it does), "sample" / "shard" as each one finishes.
    """

    stage: str
    event: str
    message: str
    samples_total: int = 0  # the whole train split
    samples_planned: int = 0  # in the shards this run (re)generates
    samples_done: int = 0
    samples_failed: int = 0
    tokens_done: int = 0
    shards_planned: int = 0
    shards_done: int = 0
    extract_s: float = 0.0  # since extraction began

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_done / self.extract_s if self.extract_s > 0 else 0.0


@dataclass(frozen=True)
class ExtractionSummary:
    """What one :func:`draftflow.extraction.run_extraction` did."""

    data_root: str
    samples_total: int
    samples_present_before: int
    shards_total: int
    shards_written: int
    samples_ok: int
    samples_failed: int
    tokens: int
    seconds: float
    vllm_version: str | None
    failures: tuple[tuple[str, str], ...] = ()  # the first few (sample_id, reason)
    server_started: bool = False
    unverified: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.samples_failed == 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def with_server(self, started: bool, unverified: tuple[str, ...]) -> ExtractionSummary:
        return dataclasses.replace(self, server_started=started, unverified=unverified)

    def __str__(self) -> str:
        if self.shards_written:
            work = (
                f"{self.shards_written} of {self.shards_total} shards written: {self.samples_ok} samples ok, "
                f"{self.samples_failed} failed, {self.tokens} tokens in {self.seconds:.1f}s "
                f"({self.tokens_per_s:.0f} tokens/s)"
            )
        else:
            work = f"nothing to do: all {self.shards_total} shards complete"
        lines = [
            f"data folder  {self.data_root}",
            f"samples      {self.samples_total} in the train split; {self.samples_present_before} already present",
            f"this run     {work}",
            f"vLLM         {self.vllm_version or '-'}"
            + (" (started for this run)" if self.server_started else ""),
        ]
        lines += [f"failed       {sid}: {reason}" for sid, reason in self.failures]
        if self.samples_failed > len(self.failures):
            lines.append(
                f"             ... and {self.samples_failed - len(self.failures)} more (see the manifest)"
            )
        if self.samples_failed:
            lines.append("             failed samples are retried by the next `draftflow extract`")
        return "\n".join(lines)


class ProgressTracker:
    """Counts samples and shards as they finish and forwards events to an optional callback.

    All calls come from the event loop's thread, so plain counters suffice.
    """

    def __init__(self, callback: Callable[[ExtractionProgress], None] | None):
        self.callback = callback
        self.samples_total = self.samples_planned = self.shards_planned = self.shards_total = self.present = 0
        self.done = self.failed = self.tokens = self.shards_done = 0
        self.started = time.monotonic()

    def _event(self, stage: str, event: str, message: str) -> None:
        if self.callback is None:
            return
        self.callback(
            ExtractionProgress(
                stage,
                event,
                message,
                self.samples_total,
                self.samples_planned,
                self.done,
                self.failed,
                self.tokens,
                self.shards_planned,
                self.shards_done,
                time.monotonic() - self.started,
            )
        )

    def stage(self, stage: str, message: str) -> None:
        self._event(stage, "stage", message)

    def begin(self, rec: Reconciliation, samples_total: int) -> None:
        self.samples_total, self.present = samples_total, len(rec.present)
        self.samples_planned = sum(len(s.sample_ids) for s in rec.to_generate)
        self.shards_planned = len(rec.to_generate)
        self.shards_total = len(rec.to_generate) + len(rec.complete_shards)
        self.started = time.monotonic()
        self._event(
            "extract",
            "stage",
            f"{self.shards_planned} of {self.shards_total} shards to (re)generate, "
            f"{self.samples_planned} samples",
        )

    def sample(self, num_tokens: int, ok: bool) -> None:
        self.done += 1
        if ok:
            self.tokens += num_tokens
        else:
            self.failed += 1
        self._event("extract", "sample", "")

    def shard_done(self, result: ShardResult) -> None:
        self.shards_done += 1
        self._event(
            "extract",
            "shard",
            f"shard {result.shard_id} committed ({result.samples_ok} ok, {result.samples_failed} failed)",
        )

    def summary(
        self, root: str, results: Sequence[ShardResult], vllm_version: str | None
    ) -> ExtractionSummary:
        failures = tuple(f for r in results for f in r.failures)
        return ExtractionSummary(
            data_root=root,
            samples_total=self.samples_total,
            samples_present_before=self.present,
            shards_total=self.shards_total,
            shards_written=len(results),
            samples_ok=sum(r.samples_ok for r in results),
            samples_failed=len(failures),
            tokens=sum(r.tokens for r in results),
            seconds=time.monotonic() - self.started,
            vllm_version=vllm_version,
            failures=failures[:_FAILURES_KEPT],
        )
