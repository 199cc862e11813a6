"""The commit protocol: shard first, fragment second; orphans invisible; races harmless; ids safe."""

from __future__ import annotations

import random
import threading
import time

import pyarrow as pa
import pytest
import store_synthetic as syn

from draftflow import paths
from draftflow.store import (
    ExpectedSample,
    FailedSample,
    Store,
    gc,
    iter_shard,
    load_sample,
    ls,
    read_manifest,
    reconcile,
    verify,
    write_shard,
)
from draftflow.store.manifest import read_raw, resolve, to_ipc_bytes
from draftflow.store.writer import GC_GRACE_S


def test_orphan_shard_is_invisible_and_collected_after_grace(store):
    committed = write_shard(store, "000000", [syn.sample("o1"), syn.sample("o2")], syn.info())
    store.delete(committed.fragment_url)  # as if the writer died between its two steps

    assert len(read_manifest(store)) == 0
    assert ls(store).orphan_objects == 1
    result = reconcile(store, syn.expected(0) + [ExpectedSample("o1", syn.num_tokens_for("o1"))], 2)
    assert result.missing == ("o1",) and result.to_generate[0].attempt == 1

    young = gc(store)  # default grace: hours
    assert young.orphan_shards == () and young.young_orphans_kept == 1
    old = gc(store, now=time.time() + GC_GRACE_S + 60, force=True)  # as if the grace had passed
    assert old.orphan_shards == (committed.shard_url,)
    assert store.list(store.layout.shards_dir, paths.SHARD_SUFFIX) == []


def test_gc_never_touches_committed_shards(store):
    committed = write_shard(store, "000000", [syn.sample("g1")], syn.info())
    report = gc(store, now=time.time() + GC_GRACE_S + 60)  # as if the grace had passed
    assert report.orphan_shards == () and report.temp_files == ()
    assert verify(store).ok
    assert [e.url for e in store.list(store.layout.shards_dir)] == [committed.shard_url]


def test_failed_write_leaves_no_object(store):
    """An exception mid-write must abort, not commit, the partial object (fsspec's close() commits)."""
    if store.layout.root.startswith("s3://"):
        # Small parts, so the abort has a real multipart upload to cancel.
        store = Store(store.layout, {**store.storage_options, "default_block_size": 5 << 20})
    url = store.layout.shard("000000", "deadbeef")

    def write_then_fail(f):
        f.write(b"x" * (11 << 20))
        raise RuntimeError("extraction server went away")

    with pytest.raises(RuntimeError, match="went away"):
        store.write_atomic(url, write_then_fail)
    assert store.list(store.layout.shards_dir, include_temp=True) == []
    if store.layout.root.startswith("s3://"):
        fs, path = store.fs(url)
        bucket, key, _ = fs.split_path(path)
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", [])
        assert uploads == []


def test_concurrent_writers_of_one_shard_list_each_sample_once(store):
    samples = [syn.sample(f"c{i}") for i in range(5)]
    start = threading.Barrier(2)
    results, errors = [], []

    def run():
        try:
            start.wait()
            results.append(write_shard(store, "000000", samples, syn.info()))
        except Exception as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

    raw = read_raw(store)
    assert len(raw) == 10 and len(set(raw["writer"].to_pylist())) == 2  # both commits exist
    manifest = read_manifest(store)
    assert sorted(manifest["sample_id"].to_pylist()) == [s.sample_id for s in samples]
    assert verify(store).ok
    created = {r["writer"]: r["created_at"] for r in raw.to_pylist()}
    assert set(created) == {c.writer for c in results}
    winner = min(created, key=lambda w: (created[w], w))  # same attempt: earliest, then writer
    assert set(manifest["writer"].to_pylist()) == {winner}
    for got, want in zip(iter_shard(store, manifest, "000000"), samples, strict=True):
        syn.assert_same(got, want)


def test_resolution_does_not_depend_on_listing_order(local_store):
    for _ in range(3):
        write_shard(local_store, "000000", [syn.sample("d1"), syn.sample("d2")], syn.info())
    write_shard(local_store, "000001", [syn.sample("d3")], syn.info())
    raw = read_raw(local_store)
    want = resolve(raw)
    rng = random.Random(0)
    for _ in range(5):
        order = list(range(len(raw)))
        rng.shuffle(order)
        assert resolve(raw.take(order)).equals(want)


def test_higher_attempt_supersedes(local_store):
    first = write_shard(local_store, "000000", [syn.sample("h1"), FailedSample("h2", "HTTP 400")], syn.info())
    retry = write_shard(local_store, "000000", [syn.sample("h1"), syn.sample("h2")], syn.info(), attempt=2)
    late_duplicate = write_shard(local_store, "000000", [syn.sample("h1")], syn.info(), attempt=1)
    manifest = read_manifest(local_store)
    assert set(manifest["writer"].to_pylist()) == {retry.writer}
    assert {first.writer, late_duplicate.writer}.isdisjoint(manifest["writer"].to_pylist())
    assert manifest["status"].to_pylist() == ["ok", "ok"]


def test_path_traversal_ids_are_rejected(local_store):
    layout = local_store.layout
    for bad in ("../x", "..", "a/b", "/abs", "", ".hidden", "x\x00"):
        with pytest.raises(ValueError):
            write_shard(local_store, bad, [syn.sample("p1")], syn.info())
        with pytest.raises(ValueError):
            layout.shard(bad, "w")
    for key in (
        "shards/../../etc/passwd.safetensors",
        "../shards/x.safetensors",
        "shards/a/b.safetensors",
        "/etc/x.safetensors",
    ):
        with pytest.raises(ValueError):
            layout.resolve_shard_key(key)
    assert local_store.list(layout.shards_dir) == [] and len(read_manifest(local_store)) == 0

    # A crafted manifest row cannot make a reader open a file outside the shards folder.
    write_shard(local_store, "000000", [syn.sample("p1")], syn.info())
    manifest = read_manifest(local_store)
    crafted = manifest.set_column(
        manifest.schema.get_field_index("shard_uri"),
        "shard_uri",
        pa.array(["shards/../../../etc/passwd.safetensors"]),
    )
    local_store.write_atomic(layout.fragment("000001", "evil"), lambda f: f.write(to_ipc_bytes(crafted)))
    with pytest.raises(ValueError):
        load_sample(local_store, crafted, "p1")
    with pytest.raises(ValueError):
        list(iter_shard(local_store, manifest, "../000000"))
