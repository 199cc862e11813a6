"""Reconcile and corruption: every expected sample classified, incomplete shards planned and fixed."""

from __future__ import annotations

import pytest
import store_synthetic as syn

from draftflow.store import (
    CorruptShardError,
    ExpectedSample,
    FailedSample,
    Store,
    iter_shard,
    load_sample,
    read_manifest,
    reconcile,
    verify,
    write_shard,
)


def _write_plan(store: Store, plan, fail: dict[str, str] | None = None) -> None:
    fail = fail or {}
    samples = [FailedSample(s, fail[s]) if s in fail else syn.sample(s) for s in plan.sample_ids]
    write_shard(store, plan.shard_id, samples, syn.info(), attempt=plan.attempt)


def _flip_bit(store: Store, url: str, offset: int) -> None:
    """Corrupt one bit of an object in place, behind the store's back (bit rot, a bad copy)."""
    data = bytearray(store.read_all(url))
    data[offset] ^= 0x10
    fs, path = store.fs(url)
    fs.pipe_file(path, bytes(data))


def test_classification_and_stable_shard_plan(local_store):
    expected = syn.expected(7)
    ids = [e.sample_id for e in expected]
    first = reconcile(local_store, expected, 3)
    assert first.missing == tuple(ids) and first.present == ()
    assert [(p.shard_id, p.sample_ids, p.attempt) for p in first.to_generate] == [
        ("000000", tuple(ids[0:3]), 1),
        ("000001", tuple(ids[3:6]), 1),
        ("000002", tuple(ids[6:7]), 1),
    ]

    _write_plan(local_store, first.to_generate[0])
    _write_plan(local_store, first.to_generate[1], fail={ids[4]: "HTTP 400: prompt too long"})
    write_shard(local_store, "000009", [syn.sample("stray")], syn.info())
    second = reconcile(local_store, expected, 3)
    assert second.present == (*ids[0:4], ids[5])
    assert second.failed == ((ids[4], "HTTP 400: prompt too long"),)
    assert second.missing == (ids[6],) and second.corrupt == ()
    assert second.unexpected == ("stray",)
    assert second.complete_shards == ("000000",)
    assert [(p.shard_id, p.attempt, p.reasons) for p in second.to_generate] == [
        ("000001", 2, ("1 failed",)),
        ("000002", 1, ("1 missing",)),
    ]

    for plan in second.to_generate:
        _write_plan(local_store, plan)
    final = reconcile(local_store, expected, 3)
    assert final.done and final.present == tuple(ids)
    manifest = read_manifest(local_store)
    listed = [s for s in manifest["sample_id"].to_pylist() if s != "stray"]
    assert sorted(listed) == ids  # every sample exactly once


def test_bit_flip_is_caught_by_verify_reconcile_and_readers(store):
    expected = syn.expected(4)
    for plan in reconcile(store, expected, 2).to_generate:
        _write_plan(store, plan)
    manifest = read_manifest(store)
    rows = {r["sample_id"]: r for r in manifest.to_pylist()}
    victim, neighbour = rows[expected[2].sample_id], rows[expected[3].sample_id]
    url = store.layout.resolve_shard_key(victim["shard_uri"])
    _flip_bit(store, url, victim["hidden_states_offset"] + 3)

    report = verify(store)
    assert [(b.shard_id, b.reason) for b in report.bad] == [("000001", "sha256 mismatch")]
    with pytest.raises(CorruptShardError):
        load_sample(store, manifest, victim["sample_id"])
    with pytest.raises(CorruptShardError):
        list(iter_shard(store, manifest, "000001"))
    with pytest.raises(CorruptShardError):
        load_sample(store, manifest, victim["sample_id"], verify="sample")
    # The per-sample checksum isolates the damage: the neighbour's bytes are intact.
    syn.assert_same(
        load_sample(store, manifest, neighbour["sample_id"], verify="sample"),
        syn.sample(neighbour["sample_id"]),
    )

    result = reconcile(store, expected, 2)
    assert result.corrupt == (expected[2].sample_id, expected[3].sample_id)
    assert result.complete_shards == ("000000",)
    (plan,) = result.to_generate
    assert (plan.shard_id, plan.attempt, plan.reasons) == ("000001", 2, ("corrupt: sha256 mismatch",))

    _write_plan(store, plan)
    assert reconcile(store, expected, 2).done
    assert verify(store).ok
    syn.assert_same(
        load_sample(store, read_manifest(store), victim["sample_id"]), syn.sample(victim["sample_id"])
    )


def test_missing_object_and_token_count_mismatch_are_corrupt(local_store):
    expected = syn.expected(4)
    committed = [
        write_shard(local_store, p.shard_id, [syn.sample(s) for s in p.sample_ids], syn.info())
        for p in reconcile(local_store, expected, 2).to_generate
    ]
    local_store.delete(committed[0].shard_url)
    wrong = [ExpectedSample(e.sample_id, e.num_tokens + (1 if i == 3 else 0)) for i, e in enumerate(expected)]
    result = reconcile(local_store, wrong, 2, verify=False)
    assert result.corrupt == tuple(e.sample_id for e in expected[0:2]) + (expected[3].sample_id,)
    assert [p.reasons for p in result.to_generate] == [
        ("corrupt: shard object missing",),
        ("1 token count mismatch",),
    ]


def test_reconcile_rejects_duplicate_expected_ids(local_store):
    with pytest.raises(ValueError, match="duplicate"):
        reconcile(local_store, [ExpectedSample("a", 3), ExpectedSample("a", 3)], 2)


def test_a_shard_of_failures_only_is_committed_and_replanned(local_store):
    expected = syn.expected(2)
    (plan,) = reconcile(local_store, expected, 2).to_generate
    _write_plan(local_store, plan, fail={e.sample_id: "server unreachable" for e in expected})
    manifest = read_manifest(local_store)
    assert manifest["status"].to_pylist() == ["failed", "failed"]
    assert verify(local_store).ok and list(iter_shard(local_store, manifest, plan.shard_id)) == []
    with pytest.raises(LookupError, match="server unreachable"):
        load_sample(local_store, manifest, expected[0].sample_id)
    (retry,) = reconcile(local_store, expected, 2).to_generate
    assert retry.attempt == 2 and retry.reasons == ("2 failed",)
