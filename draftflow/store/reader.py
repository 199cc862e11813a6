"""Reading samples back, and checking shards against their manifest checksums.

Three levels of checking, chosen per call (``verify=``):

* ``"shard"`` (default): the first time this process touches a shard, its whole object is
  hashed and compared with the manifest's ``shard_sha256``; verified shards are remembered
  for the life of the process (objects are immutable and uniquely named, so a verified name
  stays verified). Iterating a shard reads it whole anyway, so this costs no extra I/O there.
* ``"sample"``: only the sample's own byte range is hashed (``sample_sha256``): random
  access to one sample of a remote shard without downloading the shard.
* ``"none"``: trust the bytes.

A mismatch raises :class:`CorruptShardError`; :func:`verify` reports instead of raising.
"""

from __future__ import annotations

import hashlib
import mmap
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
import torch

from draftflow import paths
from draftflow.store.backend import Store
from draftflow.store.fp8 import DECODE_DTYPE
from draftflow.store.manifest import STATUS_OK, read_manifest
from draftflow.store.shard import Sample, SampleSpans, TensorSpan, sample_from

Verify = Literal["shard", "sample", "none"]

_verified: set[tuple[str, str]] = set()  # (shard url, sha256) verified by this process
_verified_lock = threading.Lock()


class CorruptShardError(IOError):
    """A shard's (or sample's) bytes do not match the checksum its manifest row recorded."""


def forget_verified() -> None:
    """Drop the per-process record of verified shards (the next read hashes them again)."""
    with _verified_lock:
        _verified.clear()


def _is_verified(url: str, sha256: str) -> bool:
    with _verified_lock:
        return (url, sha256) in _verified


def _mark_verified(url: str, sha256: str) -> None:
    with _verified_lock:
        _verified.add((url, sha256))


def _spans(row: Mapping) -> SampleSpans:
    return SampleSpans(
        token_ids=TensorSpan(row["token_ids_offset"], row["token_ids_length"]),
        hidden_states=TensorSpan(row["hidden_states_offset"], row["hidden_states_length"]),
        loss_mask=TensorSpan(row["loss_mask_offset"], row["loss_mask_length"]),
    )


def _sample(buf: bytearray | mmap.mmap, base: int, row: Mapping, decode_dtype: torch.dtype) -> Sample:
    return sample_from(
        buf,
        base,
        row["sample_id"],
        _spans(row),
        dtype=row["dtype"],
        token_dtype=row["token_dtype"],
        n_layers=len(row["layer_ids"]),
        hidden_size=row["hidden_size"],
        decode_dtype=decode_dtype,
    )


def _check_sample(data: bytes | bytearray | memoryview, row: Mapping) -> None:
    expected = row["sample_sha256"]
    if expected is None or hashlib.sha256(data).hexdigest() != expected:
        raise CorruptShardError(f"sample {row['sample_id']!r} in {row['shard_uri']}: checksum mismatch")


def _stream_problem(store: Store, url: str, sha256: str, nbytes: int) -> str | None:
    """Why the object at ``url`` is not the shard the manifest describes, or None if it is."""
    digest, size = hashlib.sha256(), 0
    try:
        for chunk in store.iter_chunks(url):
            digest.update(chunk)
            size += len(chunk)
    except FileNotFoundError:
        return "shard object missing"
    if size != nbytes:
        return f"size {size} != manifest {nbytes}"
    if digest.hexdigest() != sha256:
        return "sha256 mismatch"
    return None


def _ensure_verified(store: Store, url: str, sha256: str, nbytes: int) -> None:
    if _is_verified(url, sha256):
        return
    problem = _stream_problem(store, url, sha256, nbytes)
    if problem:
        raise CorruptShardError(f"{url}: {problem}")
    _mark_verified(url, sha256)


def _rows(manifest: pa.Table, column: str, value: str) -> list[dict]:
    return manifest.filter(pc.equal(manifest[column], value)).to_pylist()


def load_sample(
    store: Store,
    manifest: pa.Table,
    sample_id: str,
    *,
    verify: Verify = "shard",
    decode_dtype: torch.dtype = DECODE_DTYPE,
) -> Sample:
    """One sample's tensors, read with a single range read of its bytes (after the shard check).

    FP8 hidden states come back decoded to ``decode_dtype``; other dtypes as stored.
    """
    rows = _rows(manifest, "sample_id", sample_id)
    if not rows:
        raise KeyError(f"sample {sample_id!r} is not in the manifest")
    row = next((r for r in rows if r["status"] == STATUS_OK), rows[0])
    if row["status"] != STATUS_OK:
        raise LookupError(f"sample {sample_id!r} failed extraction: {row['failure_reason']}")
    url = store.layout.resolve_shard_key(row["shard_uri"])
    if verify == "shard":
        _ensure_verified(store, url, row["shard_sha256"], row["shard_bytes"])
    spans = _spans(row)
    # bytearray: torch needs a writable buffer to view it without copying again.
    data = bytearray(store.read_range(url, spans.start, spans.end))
    if verify == "sample":
        _check_sample(data, row)
    return _sample(data, spans.start, row, decode_dtype)


def _read_whole(store: Store, url: str) -> bytearray | mmap.mmap:
    fs, path = store.fs(url)
    if store.is_local():
        with open(path, "rb") as f:
            # Copy-on-write map: pages load lazily, tensors may be written without touching the file.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return bytearray(fs.cat_file(path))


def iter_shard(
    store: Store,
    manifest: pa.Table,
    shard_id: str,
    *,
    verify: Verify = "shard",
    decode_dtype: torch.dtype = DECODE_DTYPE,
) -> Iterator[Sample]:
    """The successful samples of one shard, in order, from one sequential read of the shard.

    Local shards are memory-mapped (the returned tensors view the map); remote shards are
    downloaded whole into memory, so size shards to fit comfortably in RAM.
    """
    rows = sorted(
        (r for r in _rows(manifest, "shard_id", paths.safe_component(shard_id)) if r["status"] == STATUS_OK),
        key=lambda r: r["index_in_shard"],
    )
    if not rows:
        return
    first = rows[0]
    url = store.layout.resolve_shard_key(first["shard_uri"])
    buf = _read_whole(store, url)
    if verify == "shard" and not _is_verified(url, first["shard_sha256"]):
        if len(buf) != first["shard_bytes"] or hashlib.sha256(buf).hexdigest() != first["shard_sha256"]:
            raise CorruptShardError(f"{url}: size or sha256 does not match the manifest")
        _mark_verified(url, first["shard_sha256"])
    for row in rows:
        spans = _spans(row)
        if verify == "sample":
            _check_sample(memoryview(buf)[spans.start : spans.end], row)
        yield _sample(buf, 0, row, decode_dtype)


@dataclass(frozen=True)
class BadShard:
    shard_id: str
    shard_uri: str
    reason: str


@dataclass(frozen=True)
class VerifyReport:
    """Result of :func:`verify`: how many shards were hashed and which ones failed."""

    checked: int
    bad: tuple[BadShard, ...]

    @property
    def ok(self) -> bool:
        return not self.bad


def verify(store: Store, manifest: pa.Table | None = None, *, workers: int = 4) -> VerifyReport:
    """Re-hash every shard the (resolved) manifest lists; report, never raise, on mismatch.

    Streams each object in chunks (constant memory). Shards that pass are remembered as
    verified for this process, so a later :func:`load_sample` does not hash them again.
    """
    manifest = read_manifest(store) if manifest is None else manifest
    shards = (
        manifest.select(["shard_id", "shard_uri", "shard_sha256", "shard_bytes"])
        .group_by(["shard_id", "shard_uri", "shard_sha256", "shard_bytes"])
        .aggregate([])
        .to_pylist()
    )
    listed = {e.url: e.size for e in store.list(store.layout.shards_dir, paths.SHARD_SUFFIX)}

    def check(shard: dict) -> BadShard | None:
        url = store.layout.resolve_shard_key(shard["shard_uri"])
        if url not in listed:
            problem = "shard object missing"
        elif listed[url] != shard["shard_bytes"]:
            problem = f"size {listed[url]} != manifest {shard['shard_bytes']}"
        else:
            problem = _stream_problem(store, url, shard["shard_sha256"], shard["shard_bytes"])
        if problem is None:
            _mark_verified(url, shard["shard_sha256"])
            return None
        return BadShard(shard["shard_id"], shard["shard_uri"], problem)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(check, shards))
    bad = tuple(sorted((b for b in results if b), key=lambda b: b.shard_id))
    return VerifyReport(len(shards), bad)
