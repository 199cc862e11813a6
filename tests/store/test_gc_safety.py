"""gc against readers and writers in flight: grace from the compaction that dropped a shard, a
minimum grace, and ages measured on the store's clock (local and loopback S3)."""

from __future__ import annotations

import os
import time

import pytest
import store_synthetic as syn

from draftflow import paths
from draftflow.cli import main as cli_main
from draftflow.store import compact, gc, load_sample, read_manifest, write_shard
from draftflow.store.writer import GC_GRACE_S, MIN_GC_GRACE_S


def test_grace_counts_from_the_compaction_that_dropped_a_shard(local_store):
    """A trainer indexed the manifest, then a regenerated commit superseded the shard it reads and
    a compaction dropped it: gc must leave that (long uploaded) object alone for the grace."""
    old = write_shard(local_store, "000000", [syn.sample("a"), syn.sample("b")], syn.info())
    long_ago = time.time() - 30 * 24 * 3600
    os.utime(old.shard_url, (long_ago, long_ago))  # uploaded a month ago
    reader_view = read_manifest(local_store)  # what a running trainer holds
    write_shard(local_store, "000000", [syn.sample("a"), syn.sample("b")], syn.info(), attempt=2)
    compact(local_store)
    assert old.shard_url not in {
        local_store.layout.resolve_shard_key(u) for u in read_manifest(local_store)["shard_uri"].to_pylist()
    }

    report = gc(local_store)  # default grace, right after the compaction
    assert report.orphan_shards == () and report.young_orphans_kept == 1
    assert load_sample(local_store, reader_view, "a").sample_id == "a"  # the trainer still reads it

    later = gc(local_store, now=time.time() + GC_GRACE_S + 60)
    assert later.orphan_shards == (old.shard_url,)
    records = local_store.list(local_store.layout.compacted_dir, paths.DROPPED_SUFFIX)
    assert records == []  # the dropped record goes with the last object it names


def test_grace_below_the_commit_deadline_is_refused(local_store, capsys):
    committed = write_shard(local_store, "000000", [syn.sample("u")], syn.info())
    local_store.delete(committed.fragment_url)  # uploaded, fragment still to come
    with pytest.raises(ValueError, match="below the minimum"):
        gc(local_store, grace_s=0)
    rc = cli_main(["store", "gc", local_store.layout.root, "--grace-s", "0"])
    assert rc != 0 and "below the minimum" in capsys.readouterr().err
    assert [e.url for e in local_store.list(local_store.layout.shards_dir, paths.SHARD_SUFFIX)] == [
        committed.shard_url
    ]
    assert gc(local_store, grace_s=MIN_GC_GRACE_S).orphan_shards == ()


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_fast_host_clock_does_not_age_objects(make_store, backend, monkeypatch):
    """The gc host's clock runs a day ahead: a shard uploaded a moment ago, whose fragment is still
    to come, is young on the store's clock and stays."""
    store = make_store(backend)
    committed = write_shard(store, "000000", [syn.sample("w")], syn.info())
    store.delete(committed.fragment_url)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 24 * 3600)
    report = gc(store)
    assert report.orphan_shards == () and report.young_orphans_kept == 1
