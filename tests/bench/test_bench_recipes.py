"""The benchmarks that start their own extraction server write recipes that accept its files.

A client only reads and deletes hidden-state files inside the recipe's staging folders; a
benchmark whose recipe leaves its server's folder out fails every request
("server named a file outside the staging folder(s)"), as bench/fp8.py once did."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftflow.extraction.shards import staging_folders
from draftflow.plan import Plan


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_fp8_bench_recipe_accepts_its_servers_files(
    tmp_path: Path, smollm2_dir: Path, dtype: str, bench_args, bench_module
):
    fp8 = bench_module("fp8")
    args = bench_args(fp8, "--model", str(smollm2_dir))
    staging = str(tmp_path / "staging")
    plan = Plan.load(fp8.recipe(args, tmp_path, "http://127.0.0.1:1", staging, dtype))
    assert staging in staging_folders(plan)
    assert plan.recipe.extraction.dtype == dtype


@pytest.mark.slow
def test_generation_bench_recipe_accepts_the_extraction_servers_files(
    tmp_path: Path, smollm2_dir: Path, bench_args, bench_module
):
    generation = bench_module("generation")
    args = bench_args(generation, "--model", str(smollm2_dir))
    staging = str(tmp_path / "staging")
    plan = Plan.load(generation.write_recipe(args, tmp_path, "http://127.0.0.1:1", staging))
    assert staging in staging_folders(plan)
