"""bench/faults.py runs the suite's one-kill fault tests as whole series: the node ids it names
exist, and each of those tests takes its kill count from tests/fault_series.py."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_series_the_bench_runs_is_a_test_that_takes_its_count_from_fault_series(bench_module):
    faults = bench_module("faults")
    assert len(faults.SERIES_TESTS) == 3
    for node in faults.SERIES_TESTS:
        path, name = node.split("::")
        tree = ast.parse((REPO / path).read_text())
        assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, node
        calls = {
            c.func.id for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
        }
        assert {"kills", "report"} <= calls, f"{path} does not size its series with fault_series.kills"


def test_the_suite_injects_one_kill_per_series_and_the_bench_the_whole_series(monkeypatch):
    import importlib

    import fault_series

    monkeypatch.delenv("DRAFTFLOW_FAULT_SERIES", raising=False)
    assert importlib.reload(fault_series).kills(10) == 1
    monkeypatch.setenv("DRAFTFLOW_FAULT_SERIES", "1")
    assert importlib.reload(fault_series).kills(10) == 10
    monkeypatch.delenv("DRAFTFLOW_FAULT_SERIES")
    importlib.reload(fault_series)
