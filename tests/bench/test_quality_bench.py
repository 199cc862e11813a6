"""bench/quality.py runs its draftflow commands from the repository root, so the paths a user
gives it must be taken from where the user stands, not from there."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_relative_paths_are_read_from_the_callers_folder(
    tmp_path: Path, monkeypatch, bench_module, bench_args
):
    quality = bench_module("quality")
    (tmp_path / "runs" / "export").mkdir(parents=True)
    (tmp_path / "my.yaml").write_text("name: x\n")
    monkeypatch.chdir(tmp_path)
    args = bench_args(quality, "--checkpoint", "runs/export", "--recipe", "my.yaml", "--out", "bq")
    assert Path(args.checkpoint) == tmp_path / "runs" / "export"
    assert args.recipe == tmp_path / "my.yaml"
    assert args.out == tmp_path / "bq"


def test_compared_exports_are_read_from_the_callers_folder_and_named_by_their_recipe(
    tmp_path: Path, monkeypatch, bench_module, bench_args
):
    quality = bench_module("quality")
    monkeypatch.chdir(tmp_path)
    args = bench_args(quality, "--compare", "a/runs/eagle3-fp1/r1/export", "b/dflash-run", "a@b/x@2")
    assert args.compare == [
        (str(tmp_path / "a/runs/eagle3-fp1/r1/export"), None),
        (str(tmp_path / "b/dflash-run"), None),
        (str(tmp_path / "a@b/x"), 2),  # @K: served with K drafted tokens
    ]
    assert [quality.drafter_label(c) for c, _ in args.compare] == ["eagle3-fp1", "dflash-run", "x"]
    assert bench_args(quality).compare == []
    assert bench_args(quality, "--compare", "x", "--interleave").interleave


def test_interleave_needs_drafters_to_race(bench_module, bench_args):
    quality = bench_module("quality")
    with pytest.raises(SystemExit):
        bench_args(quality, "--interleave")
