"""SIGKILL a writer at random instants: readers never see partial state, and a rerun completes the set."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import store_synthetic as syn
import store_writer_loop
from fault_series import kills, report

from draftflow import paths
from draftflow.store import Store, gc, ls, read_manifest, reconcile, verify
from draftflow.store.shard import data_end, read_header
from draftflow.store.writer import GC_GRACE_S

REPO = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("store_writer_loop.py")
PER_SHARD = 4
TRIALS = kills(10)
# (samples, hidden size) per backend. Local: many small shards, many commit boundaries to hit.
# S3: shards of ~5-6 MB, so with 5 MiB parts some are multipart uploads killed mid-way.
SIZES = {"local": (48, 2048), "s3": (16, 8192)}


def _start(store: Store, num_samples: int, hidden: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = [
        store.layout.root,
        json.dumps(store.storage_options),
        str(num_samples),
        str(PER_SHARD),
        str(hidden),
    ]
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def _writing_time(store: Store, num_samples: int, hidden: int) -> float:
    """Seconds from `ready` to `done` of an uninterrupted writer: the window kills are drawn from."""
    proc = _start(store, num_samples, hidden)
    started = time.monotonic()
    assert proc.stdout.readline().strip() == "done"
    window = time.monotonic() - started
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return window


def _assert_nothing_partial_is_visible(store: Store, expected_ids: set[str]) -> None:
    manifest = read_manifest(store)  # every fragment under a final name parses
    ids = manifest["sample_id"].to_pylist()
    assert len(ids) == len(set(ids)) and set(ids) <= expected_ids
    report = verify(store)  # every listed shard exists, full size, checksum matches
    assert report.ok, report.bad
    for entry in store.list(store.layout.shards_dir, paths.SHARD_SUFFIX):
        # Even unlisted (orphan) objects under a final name are whole shards, never a prefix.
        head = store.read_range(entry.url, 0, 8)
        header_len = int.from_bytes(head, "little")
        header, data_start = read_header(store.read_range(entry.url, 0, 8 + header_len))
        assert entry.size == data_start + data_end(header), entry.name


def _writes_in_flight(store: Store) -> int:
    """Writes the kill cut short: local temp files, or S3 multipart uploads never completed."""
    if not store.layout.root.startswith("s3://"):
        return len(store.list(store.layout.shards_dir, paths.TEMP_SUFFIX, include_temp=True))
    fs, path = store.fs(store.layout.shards_dir)
    bucket, prefix, _ = fs.split_path(path)
    return len(fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", []))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sigkill_at_random_points(backend, make_store):
    seed = int(os.environ.get("DRAFTFLOW_CRASH_SEED", "1234"))
    rng = random.Random(seed)
    num_samples, hidden = SIZES[backend]
    expected = syn.expected(num_samples)
    expected_ids = {e.sample_id for e in expected}

    def fresh() -> Store:
        store = make_store(backend)
        if backend == "s3":
            store = Store(store.layout, {**store.storage_options, "default_block_size": 5 << 20})
        return store

    window = _writing_time(fresh(), num_samples, hidden)
    outcomes = []
    for trial in range(TRIALS):
        store = fresh()
        proc = _start(store, num_samples, hidden)
        time.sleep(rng.uniform(0, window) if TRIALS > 1 else window / 2)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        _assert_nothing_partial_is_visible(store, expected_ids)
        summary = ls(store)
        outcomes.append((summary.samples_ok, summary.orphan_objects, _writes_in_flight(store)))

        # The rerun (in this process: same code, no second interpreter start) completes the set.
        store_writer_loop.main(
            store.layout.root, json.dumps(store.storage_options), num_samples, PER_SHARD, hidden
        )
        assert reconcile(store, expected, PER_SHARD).done, f"trial {trial} (seed {seed})"
        listed = read_manifest(store)["sample_id"].to_pylist()
        assert sorted(listed) == sorted(expected_ids), f"trial {trial} (seed {seed})"
        gc(store, now=time.time() + GC_GRACE_S + 60)  # as if the grace had passed
        assert reconcile(store, expected, PER_SHARD, verify=False).done and ls(store).orphan_objects == 0
        assert store.list(store.layout.shards_dir, paths.TEMP_SUFFIX, include_temp=True) == []
    # (samples committed, orphan shard objects, writes cut short) at each kill, for the log.
    report(
        f"kill -9 of a shard writer, {backend} (tests/store/test_crash_safety.py)",
        TRIALS,
        f"window {window:.2f}s, seed {seed}, (committed, orphan objects, writes cut) at each kill {outcomes}; "
        "0 partial visible, every rerun complete",
    )
