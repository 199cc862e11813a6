"""Progress of long tasks in Prefect: a log line and a progress artifact per update.

The counting is :mod:`draftflow.progress` (core, no Prefect); this module only supplies the
sinks: the task's logger, and a progress artifact whose description carries the same line
(done/total, rate, ETA, failures).
"""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from draftflow.progress import LineSink, ProgressSnapshot


class PrefectProgress:
    """A sink: ``logger.info(line)`` and the artifact ``key`` updated (created on first use)."""

    def __init__(self, key: str, description: str):
        self.key, self.description = key, description
        self.logger = get_run_logger()
        self.artifact = None

    def __call__(self, snap: ProgressSnapshot) -> None:
        self.logger.info("%s", snap.line())
        percent = 100.0 * (snap.fraction if snap.fraction is not None else (1.0 if snap.finished else 0.0))
        if self.artifact is None:
            self.artifact = create_progress_artifact(progress=percent, key=self.key, description=snap.line())
        else:
            update_progress_artifact(self.artifact, progress=percent, description=snap.line())


def prefect_sinks(key: str, description: str) -> tuple[LineSink | PrefectProgress, ...]:
    return (PrefectProgress(key, description),)
