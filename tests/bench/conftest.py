"""Benchmarks live in bench/ as scripts, not a package: tests load them by file."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench_module():
    """``bench_module("fp8")``: the script bench/fp8.py as a module."""
    return load_bench


@pytest.fixture
def bench_args(monkeypatch):
    """``bench_args(module, "--model", m)``: the benchmark's own argument parsing (its defaults and
    post-processing) of that command line."""

    def parse(module, *argv: str) -> argparse.Namespace:
        monkeypatch.setattr("sys.argv", [module.__file__, *argv])
        return module.parse_args()

    return parse
