"""The kill -9 series of publishing (bench/publish_faults.py), a few kills per destination.

A version a reader would take for complete (a local version folder; an S3 version with its
PUBLISHED marker) is never torn after a kill, and the next push completes it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_a_killed_publish_never_shows_a_torn_version(bench_module, tmp_path: Path):
    faults = bench_module("publish_faults")
    results = faults.run(kills=4, files=32, seed=1, work=tmp_path)
    for backend, result in results.items():
        assert result["torn_versions_seen"] == 0, (backend, result)
        assert result["final"]["torn"] == 0 and result["final"]["looks_complete"] >= 1, (backend, result)
    assert sum(r["landed"]["before the end"] for r in results.values()) >= 2, results  # kills mid-push
