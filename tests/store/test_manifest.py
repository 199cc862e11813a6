"""Manifest: compaction keeps the table, is idempotent and crash-safe; `ls` counts what is there."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest
import store_synthetic as syn

from draftflow import paths
from draftflow.store import FailedSample, Store, compact, gc, ls, read_manifest, verify, write_shard
from draftflow.store.manifest import SCHEMA, from_ipc_bytes, to_ipc_bytes
from draftflow.store.writer import GC_GRACE_S


def _populate(store) -> None:
    write_shard(store, "000000", [syn.sample("m0"), syn.sample("m1")], syn.info())
    write_shard(store, "000000", [syn.sample("m0"), syn.sample("m1")], syn.info())  # a racing duplicate
    write_shard(store, "000001", [syn.sample("m2"), FailedSample("m3", "prompt too long", 5000)], syn.info())
    write_shard(store, "000002", [syn.sample("m4")], syn.info(mode="online"))


def test_compaction_preserves_the_table_and_is_idempotent(store):
    _populate(store)
    before = read_manifest(store)
    assert compact(store) is not None
    assert store.list(store.layout.fragments_dir, paths.ARROW_SUFFIX) == []
    assert len(store.list(store.layout.compacted_dir, paths.ARROW_SUFFIX)) == 1
    assert read_manifest(store).equals(before)

    assert compact(store) is None  # nothing left to merge
    assert read_manifest(store).equals(before)

    # New commits after a compaction merge with it; a second compaction folds both tables.
    write_shard(store, "000003", [syn.sample("m5")], syn.info())
    after_new = read_manifest(store)
    assert len(after_new) == len(before) + 1
    compact(store)
    assert len(store.list(store.layout.compacted_dir, paths.ARROW_SUFFIX)) == 1
    assert read_manifest(store).equals(after_new)
    assert verify(store).ok


def test_compaction_interrupted_before_deleting_loses_and_duplicates_nothing(local_store):
    _populate(local_store)
    before = read_manifest(local_store)
    fragments = {
        e.url: local_store.read_all(e.url) for e in local_store.list(local_store.layout.fragments_dir)
    }
    compact(local_store)
    # Put the merged fragments back: the state a crash between "write table" and "delete" leaves.
    for url, data in fragments.items():
        local_store.write_atomic(url, lambda f, data=data: f.write(data))
    assert read_manifest(local_store).equals(before)
    compact(local_store)
    assert read_manifest(local_store).equals(before)


def test_compaction_drops_losing_duplicates_so_gc_can_reclaim_them(local_store):
    _populate(local_store)
    assert ls(local_store).superseded_fragments == 1
    compact(local_store)
    summary = ls(local_store)
    assert summary.superseded_fragments == 0 and summary.orphan_objects == 1
    assert len(gc(local_store, now=time.time() + GC_GRACE_S + 60).orphan_shards) == 1  # grace passed
    assert verify(local_store).ok and ls(local_store).orphan_objects == 0


def test_ls_summary(local_store):
    _populate(local_store)
    summary = ls(local_store)
    ok_tokens = sum(syn.num_tokens_for(s) for s in ("m0", "m1", "m2", "m4"))
    assert (summary.fragments, summary.compacted_tables, summary.shards) == (4, 0, 3)
    assert (summary.samples_ok, summary.samples_failed, summary.duplicate_sample_ids) == (4, 1, 0)
    assert summary.tokens == ok_tokens and 0 < summary.loss_tokens <= ok_tokens
    assert summary.dtypes == ("bfloat16",) and summary.targets == ("test/tiny-target",)
    assert "4 ok, 1 failed" in str(summary)


def test_manifest_rows_carry_every_documented_field(local_store):
    _populate(local_store)
    rows = {r["sample_id"]: r for r in read_manifest(local_store).to_pylist()}
    ok, failed = rows["m2"], rows["m3"]
    assert ok["status"] == "ok" and ok["shard_uri"].startswith("shards/000001-")
    assert len(ok["shard_sha256"]) == 64 and len(ok["sample_sha256"]) == 64
    assert ok["layer_ids"] == [2, 3, 4] and ok["hidden_size"] == 16 and ok["target_revision"] == "abc123"
    assert ok["vllm_version"] == "0.32.0" and ok["mode"] == "offline" and ok["created_at"] is not None
    assert failed["status"] == "failed" and failed["failure_reason"] == "prompt too long"
    assert failed["num_tokens"] == 5000 and failed["hidden_states_offset"] is None
    assert rows["m4"]["mode"] == "online"


def test_older_fragments_without_new_optional_columns_still_read():
    full = SCHEMA.empty_table()
    narrow = full.drop_columns(["sample_sha256", "vllm_version"])
    assert from_ipc_bytes(to_ipc_bytes(narrow)).schema == SCHEMA
    assert isinstance(from_ipc_bytes(to_ipc_bytes(full)), pa.Table)


@pytest.mark.parametrize("moment", ["after the first listing", "after listing everything"])
def test_a_compaction_under_a_readers_feet_loses_nothing(local_store, monkeypatch, moment):
    """Files listed by a reader vanish (merged and deleted) before it reads them: it lists again.

    "After the first listing" also pins the listing order: had compacted tables been listed
    before fragments, the reader would see neither the new table nor the deleted fragments.
    """
    for k in range(3):
        write_shard(local_store, f"{k:06d}", [syn.sample(f"x{k}")], syn.info())
    want = read_manifest(local_store)
    original_list, original_read = Store.list, Store.read_many
    fired = []

    def compact_once():
        if not fired:
            fired.append(True)
            compact(local_store)

    def list_then_compact(self, folder, *args, **kw):
        out = original_list(self, folder, *args, **kw)
        if moment == "after the first listing":
            compact_once()
        return out

    def compact_then_read(self, urls):
        if moment == "after listing everything":
            compact_once()
        return original_read(self, urls)

    monkeypatch.setattr(Store, "list", list_then_compact)
    monkeypatch.setattr(Store, "read_many", compact_then_read)
    assert read_manifest(local_store).equals(want)
    assert fired and local_store.list(local_store.layout.fragments_dir) == []
