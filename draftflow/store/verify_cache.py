"""Re-hash shards only when their objects changed: a per-host record of verified objects.

Planning (``plan-shards`` in the Prefect flow, the extraction CLI) must see a same-size bit
flip, which only a hash shows, yet re-hashing a whole store on every run costs a full read.
So each shard object is hashed once, and the result is remembered under the object's
identity as a listing shows it: URL, size, modification time (local mtime, S3's
LastModified, which any rewrite changes) and the manifest's sha256. A later plan re-hashes
only objects whose identity changed or that were never verified: once per shard per change.

The record lives on this host (``$DRAFTFLOW_HOME/cache/verified-shards/``), one file per
store, never in the store itself: a reader must not trust a verdict another host wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pyarrow as pa

from draftflow import paths
from draftflow.recipe.load import default_home
from draftflow.store.backend import Store
from draftflow.store.reader import verify as verify_shards

_lock = threading.Lock()  # shard tasks of one flow run share the file


def _record_path(store: Store) -> Path:
    digest = hashlib.sha256(store.layout.root.encode()).hexdigest()[:24]
    return default_home() / "cache" / "verified-shards" / f"{digest}.json"


def _identity(url: str, size: int, mtime: float, sha256: str) -> str:
    return hashlib.sha256(f"{url}\0{size}\0{mtime!r}\0{sha256}".encode()).hexdigest()


def _load(path: Path) -> set[str]:
    try:
        return set(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError):
        return set()


def _save(path: Path, known: set[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps(sorted(known)))
    os.replace(tmp, path)


def bad_shards(store: Store, manifest: pa.Table) -> dict[str, str]:
    """shard_id -> problem for listed shards that are missing, of the wrong size or corrupt,
    hashing only objects not verified before in their current form (see module docstring)."""
    listed = {e.url: e for e in store.list(store.layout.shards_dir, paths.SHARD_SUFFIX)}
    shards = (
        manifest.select(["shard_id", "shard_uri", "shard_sha256", "shard_bytes"])
        .group_by(["shard_id", "shard_uri", "shard_sha256", "shard_bytes"])
        .aggregate([])
        .to_pylist()
    )
    record = _record_path(store)
    with _lock:
        known = _load(record)
    bad: dict[str, str] = {}
    to_hash: dict[str, str] = {}  # shard_id -> identity once verified
    for shard in shards:
        url = store.layout.resolve_shard_key(shard["shard_uri"])
        entry = listed.get(url)
        if entry is None:
            bad[shard["shard_id"]] = "shard object missing"
        elif entry.size != shard["shard_bytes"]:
            bad[shard["shard_id"]] = f"size {entry.size} != manifest {shard['shard_bytes']}"
        else:
            identity = _identity(url, entry.size, entry.modified, shard["shard_sha256"])
            if identity not in known:
                to_hash[shard["shard_id"]] = identity
    if to_hash:
        import pyarrow.compute as pc

        subset = manifest.filter(pc.is_in(manifest["shard_id"], pa.array(list(to_hash))))
        report = verify_shards(store, subset)
        bad.update({b.shard_id: b.reason for b in report.bad})
        with _lock:
            known = _load(record) | {identity for sid, identity in to_hash.items() if sid not in bad}
            _save(record, known)
    return bad
