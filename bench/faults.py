"""The kill series of extraction and storage: the suite's one-kill fault tests, run as series.

    .venv/bin/python bench/faults.py            # ~15 min on a 2-core CPU host

The suite keeps one representative kill per fault class (`tests/fault_series.py`); this runs
the same tests with ``DRAFTFLOW_FAULT_SERIES=1``, so each injects its whole series (random
instants, fixed seeds: ``DRAFTFLOW_CRASH_SEED`` changes them), and prints one table row per
series for docs/reliability.md. The publishing and training series have their own benches
(`bench/publish_faults.py`, `bench/train_faults.py`). A failed assertion fails the bench.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from fault_series import LINE_PREFIX  # noqa: E402

SERIES_TESTS = (
    "tests/extraction/test_vllm_lifecycle_real.py::test_a_killed_cli_leaves_no_server_and_the_data_intact",
    "tests/extraction/test_kill9_real.py::test_sigkill_at_random_points_then_rerun",
    "tests/store/test_crash_safety.py::test_sigkill_at_random_points",
)


def run(tests: tuple[str, ...] = SERIES_TESTS) -> tuple[int, list[list[str]]]:
    """Run the series; return pytest's exit code and the (fault, trials, outcome) rows printed."""
    env = {**os.environ, "DRAFTFLOW_FAULT_SERIES": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", *tests],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rows = [
        [cell.strip() for cell in line.split(LINE_PREFIX, 1)[1].split("|")]
        for line in proc.stdout.splitlines()
        if LINE_PREFIX in line
    ]
    if proc.returncode != 0:
        print(proc.stdout[-6000:], file=sys.stderr)
    return proc.returncode, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", help="pytest node ids (default: every series)")
    args = parser.parse_args()
    code, rows = run(tuple(args.tests) or SERIES_TESTS)
    print("| fault | kills | outcome |\n|---|---|---|")
    for fault, trials, outcome in rows:
        print(f"| {fault} | {trials} | {outcome} |")
    sys.exit(code)


if __name__ == "__main__":
    main()
