"""The per-host verify cache (``reconcile(..., verify="cached")``) trusts a shard only in the form
it hashed: a same-size rewrite whose modification time was put back is hashed again and caught."""

from __future__ import annotations

import os

import pytest
import store_synthetic as syn

from draftflow.store import Store, read_manifest, reconcile, write_shard


@pytest.fixture(autouse=True)
def _own_home(tmp_path, monkeypatch):
    # The record lives under $DRAFTFLOW_HOME: keep this test's verdicts out of the user's.
    monkeypatch.setenv("DRAFTFLOW_HOME", str(tmp_path / "home"))


def _extracted(store: Store, n: int = 4, per_shard: int = 2):
    expected = syn.expected(n)
    for plan in reconcile(store, expected, per_shard).to_generate:
        write_shard(store, plan.shard_id, [syn.sample(s) for s in plan.sample_ids], syn.info())
    return expected


def _flip_keeping_mtime(store: Store, url: str, offset: int) -> None:
    """Rewrite one byte in place, then put the old access and modification times back."""
    fs, path = store.fs(url)
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("backend", ["local", "shm"])
def test_same_size_same_mtime_rewrite_is_hashed_again(make_store, backend):
    store = make_store(backend)
    expected = _extracted(store)
    assert reconcile(store, expected, 2, verify="cached").done  # hashed once, remembered
    manifest = read_manifest(store)
    rows = [r for r in manifest.to_pylist() if r["shard_id"] == "000001"]
    url = store.layout.resolve_shard_key(rows[0]["shard_uri"])
    _flip_keeping_mtime(store, url, rows[0]["hidden_states_offset"] + 3)

    found = reconcile(store, expected, 2, verify="cached")
    assert [(p.shard_id, p.reasons) for p in found.to_generate] == [("000001", ("corrupt: sha256 mismatch",))]
    assert found.complete_shards == ("000000",)


@pytest.mark.parametrize("backend", ["local", "shm", pytest.param("s3", marks=pytest.mark.slow)])
def test_verified_shards_are_not_hashed_again_while_unchanged(make_store, monkeypatch, backend):
    import draftflow.store.verify_cache as verify_cache

    store = make_store(backend)
    expected = _extracted(store)
    hashed: list[int] = []
    real = verify_cache.verify_shards

    def counting(store_, manifest):
        hashed.append(len(set(manifest["shard_id"].to_pylist())))
        return real(store_, manifest)

    monkeypatch.setattr(verify_cache, "verify_shards", counting)
    assert reconcile(store, expected, 2, verify="cached").done
    assert reconcile(store, expected, 2, verify="cached").done
    assert hashed == [2]  # the second plan trusted both shards: nothing changed

    rows = [r for r in read_manifest(store).to_pylist() if r["shard_id"] == "000000"]
    url = store.layout.resolve_shard_key(rows[0]["shard_uri"])
    data = bytearray(store.read_all(url))
    data[rows[0]["hidden_states_offset"] + 1] ^= 0x01
    fs, path = store.fs(url)
    fs.pipe_file(path, bytes(data))  # same size; a new ETag on S3, a new ctime on disk
    found = reconcile(store, expected, 2, verify="cached")
    assert [p.shard_id for p in found.to_generate] == ["000000"]
    assert hashed == [2, 1]
