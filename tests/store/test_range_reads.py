"""Reading one sample reads its byte range and nothing else; shard checks happen once per process."""

from __future__ import annotations

import fsspec
import pyarrow.compute as pc
import pytest
import store_synthetic as syn

from draftflow.store import Store, load_sample, read_manifest, write_shard


class CountingFS:
    """Wraps an fsspec filesystem and records every byte handed back by a read call."""

    def __init__(self, fs, log: list):
        self._fs = fs
        self._log = log

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def cat_file(self, path, start=None, end=None, **kw):
        data = self._fs.cat_file(path, start=start, end=end, **kw)
        self._log.append(("cat_file", start, end, len(data)))
        return data

    def cat(self, *args, **kw):
        got = self._fs.cat(*args, **kw)
        self._log.append(("cat", None, None, sum(len(v) for v in got.values() if isinstance(v, bytes))))
        return got

    def open(self, path, mode="rb", **kw):
        f = self._fs.open(path, mode, **kw)
        if "r" in mode:
            read, log = f.read, self._log

            def counted_read(n=-1):
                data = read(n)
                log.append(("read", None, None, len(data)))
                return data

            f.read = counted_read
        return f


@pytest.fixture
def count_reads(monkeypatch):
    """``count_reads()`` -> a list that from now on records every read the store makes."""

    def start() -> list:
        log: list = []
        original = Store.fs
        monkeypatch.setattr(
            Store, "fs", lambda self, url: (CountingFS(original(self, url)[0], log), original(self, url)[1])
        )
        return log

    return start


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_one_sample_is_one_range_read(backend, dtype, make_store, count_reads, monkeypatch):
    store = make_store(backend)
    make = syn.fp8_sample if dtype.startswith("float8") else syn.sample
    samples = [make(f"r{i}", num_tokens=64, hidden_size=64) for i in range(8)]
    committed = write_shard(store, "000000", samples, syn.info(dtype, hidden_size=64))
    manifest = read_manifest(store)
    row = _row(manifest, "r5")
    start, end = row["token_ids_offset"], row["loss_mask_offset"] + row["loss_mask_length"]
    assert end - start < committed.nbytes / 7

    reads = count_reads()
    s3_gets = _record_s3_gets(store, monkeypatch) if backend == "s3" else None
    got = load_sample(store, manifest, "r5", verify="sample")  # FP8: the scales come in the same range
    syn.assert_same(got, syn.as_read_back(samples[5], dtype))
    assert reads == [("cat_file", start, end, end - start)]
    if s3_gets is not None:
        assert s3_gets == [f"bytes={start}-{end - 1}"]


def test_shard_checksum_is_checked_once_per_process(local_store, count_reads):
    samples = [syn.sample(f"c{i}", num_tokens=32) for i in range(4)]
    committed = write_shard(local_store, "000000", samples, syn.info())
    manifest = read_manifest(local_store)
    counted_reads = count_reads()

    load_sample(local_store, manifest, "c1")  # verify="shard": hashes the whole object first
    first = sum(n for *_, n in counted_reads)
    assert first >= committed.nbytes
    counted_reads.clear()
    syn.assert_same(load_sample(local_store, manifest, "c2"), samples[2])
    row = _row(manifest, "c2")
    assert (
        sum(n for *_, n in counted_reads)
        == row["loss_mask_offset"] + row["loss_mask_length"] - row["token_ids_offset"]
    )


def _row(manifest, sample_id: str) -> dict:
    return manifest.filter(pc.equal(manifest["sample_id"], sample_id)).to_pylist()[0]


def _record_s3_gets(store: Store, monkeypatch) -> list[str]:
    """Record the Range header of every GetObject s3fs sends (the wire-level truth)."""
    fs = fsspec.core.url_to_fs(store.layout.root, **store.storage_options)[0]
    ranges: list[str] = []
    original = fs._call_s3

    async def call_s3(method, *args, **kw):
        if method == "get_object":
            ranges.append(kw.get("Range", "whole object"))
        return await original(method, *args, **kw)

    monkeypatch.setattr(fs, "_call_s3", call_s3)
    return ranges
