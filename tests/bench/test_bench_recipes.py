"""The benchmarks that start their own extraction server write recipes that accept its files.

A client only reads and deletes hidden-state files inside the recipe's staging folders; a
benchmark whose recipe leaves its server's folder out fails every request
("server named a file outside the staging folder(s)"), as bench/fp8.py once did."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from draftflow.extraction.shards import staging_folders
from draftflow.plan import Plan


def args_of(module, monkeypatch, *argv: str) -> argparse.Namespace:
    """The benchmark's own command-line defaults, with ``argv`` on top."""
    monkeypatch.setattr("sys.argv", [module.__file__, *argv])
    return module.parse_args()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_fp8_bench_recipe_accepts_its_servers_files(
    tmp_path: Path, smollm2_dir: Path, dtype: str, monkeypatch, bench_module
):
    fp8 = bench_module("fp8")
    args = args_of(fp8, monkeypatch, "--model", str(smollm2_dir))
    staging = str(tmp_path / "staging")
    plan = Plan.load(fp8.recipe(args, tmp_path, "http://127.0.0.1:1", staging, dtype))
    assert staging in staging_folders(plan)
    assert plan.recipe.extraction.dtype == dtype


def test_generation_bench_recipe_accepts_the_extraction_servers_files(
    tmp_path: Path, smollm2_dir: Path, monkeypatch, bench_module
):
    generation = bench_module("generation")
    args = args_of(generation, monkeypatch, "--model", str(smollm2_dir))
    staging = str(tmp_path / "staging")
    plan = Plan.load(generation.write_recipe(args, tmp_path, "http://127.0.0.1:1", staging))
    assert staging in staging_folders(plan)
