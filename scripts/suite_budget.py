"""The test suite's time budget, checked after `make test`: a new slow test is a visible decision.

    python scripts/suite_budget.py .pytest-report/fast.json .pytest-report/slow.json

Reads the JSON reports that `pytest --suite-report=PATH` writes (tests/suite_plugin.py) and fails
when a test outside the `slow` marker takes over FAST_LIMIT_S, or any test takes over
SLOW_LIMIT_S without `@pytest.mark.slow_ok(reason=...)`. Prints the slowest tests and the
server start-ups either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

FAST_LIMIT_S = 5.0
SLOW_LIMIT_S = 120.0


def over_budget(tests: list[dict]) -> list[str]:
    problems = []
    for test in tests:
        if not test["slow"] and test["seconds"] > FAST_LIMIT_S:
            problems.append(
                f"{test['nodeid']}: {test['seconds']:.1f} s without the slow marker (limit {FAST_LIMIT_S:.0f} s)"
            )
        if test["seconds"] > SLOW_LIMIT_S and not test.get("slow_ok"):
            problems.append(
                f"{test['nodeid']}: {test['seconds']:.1f} s (limit {SLOW_LIMIT_S:.0f} s without "
                "@pytest.mark.slow_ok(reason=...))"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--show", type=int, default=15, help="how many of the slowest tests to print")
    args = parser.parse_args(argv)
    tests: list[dict] = []
    startups: Counter = Counter()
    for path in args.reports:
        if not path.exists():
            print(
                f"suite budget: no report at {path} (run pytest with --suite-report={path})", file=sys.stderr
            )
            return 2
        report = json.loads(path.read_text())
        tests += report["tests"]
        startups.update(report["server_startups"])
    total = sum(t["seconds"] for t in tests)
    print(f"\n{len(tests)} tests, {total / 60:.1f} min in tests; the {args.show} slowest:")
    for test in sorted(tests, key=lambda t: -t["seconds"])[: args.show]:
        tag = "slow" if test["slow"] else "fast"
        reason = f"  [slow_ok: {test['slow_ok']}]" if test.get("slow_ok") else ""
        print(f"  {test['seconds']:7.1f} s  {tag}  {test['nodeid']}{reason}")
    print("server start-ups: " + (", ".join(f"{k} {n}" for k, n in sorted(startups.items())) or "none"))
    problems = over_budget(tests)
    for problem in problems:
        print(f"over budget: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
