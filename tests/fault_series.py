"""How many faults a kill-series test injects: one representative kill in the suite, the whole
series when `bench/faults.py` runs the same test with ``DRAFTFLOW_FAULT_SERIES=1``.

The series' counts are what docs/reliability.md reports; `report` prints them on one line the
bench collects."""

from __future__ import annotations

import os

SERIES = os.environ.get("DRAFTFLOW_FAULT_SERIES") == "1"
LINE_PREFIX = "fault series |"


def kills(series: int) -> int:
    """`series` under bench/faults.py, else 1."""
    return series if SERIES else 1


def report(fault: str, trials: int, outcome: str) -> None:
    print(f"\n{LINE_PREFIX} {fault} | {trials} | {outcome}", flush=True)
