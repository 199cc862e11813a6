"""gc on a data folder whose manifest lists nothing while shard objects exist deletes nothing unless
forced: an empty manifest is far more often a lost or unreadable manifest (deleted by hand, a
wrong prefix, a half-copied folder) than a folder of nothing but orphans. Local disk and loopback S3.
"""

from __future__ import annotations

import os
import time

import pytest
import store_synthetic as syn

from draftflow import paths
from draftflow.cli import main as cli_main
from draftflow.store import gc, write_shard
from draftflow.store.writer import GC_GRACE_S, ManifestEmpty


def _shards(store) -> list[str]:
    return sorted(e.url for e in store.list(store.layout.shards_dir, paths.SHARD_SUFFIX))


def _lose_manifest(store, n: int = 3) -> list[str]:
    """`n` committed shards whose manifest fragments are then gone."""
    for i in range(n):
        committed = write_shard(store, paths.shard_id(i), [syn.sample(f"s{i}")], syn.info())
        store.delete(committed.fragment_url)
    return _shards(store)


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_an_empty_manifest_with_objects_is_refused_unless_forced(make_store, backend):
    store = make_store(backend)
    shards = _lose_manifest(store)
    later = time.time() + GC_GRACE_S + 3600  # every object is past the grace
    for dry_run in (False, True):
        with pytest.raises(ManifestEmpty, match=r"manifest lists no shard.*3 shard objects.*--force"):
            gc(store, now=later, dry_run=dry_run)
    assert _shards(store) == shards  # nothing deleted

    report = gc(store, now=later, force=True)
    assert sorted(report.orphan_shards) == shards and _shards(store) == []


def test_an_empty_manifest_with_only_young_objects_is_not_an_error(local_store):
    _lose_manifest(local_store, 1)
    report = gc(local_store)
    assert report.orphan_shards == () and report.young_orphans_kept == 1


def test_the_cli_refuses_and_deletes_with_force(local_store, capsys):
    shards = _lose_manifest(local_store)
    long_ago = time.time() - 30 * 24 * 3600
    for url in shards:
        os.utime(url, (long_ago, long_ago))
    root = local_store.layout.root

    assert cli_main(["store", "gc", root]) == 2
    err = capsys.readouterr().err
    assert "manifest lists no shard" in err and "--force" in err and root in err
    assert _shards(local_store) == shards

    assert cli_main(["store", "gc", root, "--force"]) == 0
    assert "deleted 3 orphan shards" in capsys.readouterr().out
    assert _shards(local_store) == []
