"""Re-hash shards only when their objects changed: a per-host record of verified objects.

Planning (``plan-shards`` in the Prefect flow, the extraction CLI) must see a same-size bit
flip, which only a hash shows, yet re-hashing a whole store on every run costs a full read.
So each shard object is hashed once, and the result is remembered under the object's
identity as a listing shows it: URL, size, the manifest's sha256 and a change token that no
rewrite can keep. A later plan re-hashes only objects whose identity changed or that were
never verified: once per shard per change.

The change token is never the modification time, which anyone can set back (``touch -d``,
``os.utime``, a copy that preserves times). On object stores it is the content hash the
listing carries (S3's ETag, GCS's md5/crc32c). On a local disk it is the inode and the
status-change time (ctime): every write and every ``utime`` moves ctime to now, and no call
sets it back. A backend that offers neither is hashed every time.

The record lives on this host (``$DRAFTFLOW_HOME/cache/verified-shards/``), one file per
store, never in the store itself: a reader must not trust a verdict another host wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from draftflow import paths
from draftflow.recipe.load import default_home
from draftflow.store.backend import Store
from draftflow.store.reader import verify as verify_shards

_lock = threading.Lock()  # shard tasks of one flow run share the file


def _record_path(store: Store) -> Path:
    digest = hashlib.sha256(store.layout.root.encode()).hexdigest()[:24]
    return default_home() / "cache" / "verified-shards" / f"{digest}.json"


# Content hashes object stores list with each object, in order of preference.
_CONTENT_TAGS = ("ETag", "etag", "md5Hash", "crc32c", "md5")


def _identity(url: str, size: int, change: str, sha256: str) -> str:
    return hashlib.sha256(f"{url}\0{size}\0{change}\0{sha256}".encode()).hexdigest()


def _change_token(fs: fsspec.AbstractFileSystem, info: dict) -> str | None:
    """What changes whenever the object's bytes can have changed (see module docstring), or None."""
    if isinstance(fs, LocalFileSystem):
        try:
            st = os.stat(info["name"])
        except FileNotFoundError:
            return None
        return f"local:{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}:{st.st_mtime_ns}"
    for key in _CONTENT_TAGS:
        if info.get(key):
            return f"{key}:{info[key]}"
    return None


def _listed_shards(store: Store) -> dict[str, tuple[int, str | None]]:
    """URL -> (size, change token) of every shard object, from one listing of the shards folder."""
    fs, path = store.fs(store.layout.shards_dir)
    fs.invalidate_cache(path)  # other writers' commits must show, as in Store.list
    try:
        infos = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for info in infos:
        name = info["name"].rstrip("/").rpartition("/")[2]
        if info.get("type") == "file" and name.endswith(paths.SHARD_SUFFIX) and not paths.is_temp_name(name):
            out[paths.join(store.layout.shards_dir, name)] = (
                int(info.get("size") or 0),
                _change_token(fs, info),
            )
    return out


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
    listed = _listed_shards(store)
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
    to_hash: dict[str, str | None] = {}  # shard_id -> identity to remember once verified
    for shard in shards:
        url = store.layout.resolve_shard_key(shard["shard_uri"])
        size, change = listed.get(url, (None, None))
        if size is None:
            bad[shard["shard_id"]] = "shard object missing"
        elif size != shard["shard_bytes"]:
            bad[shard["shard_id"]] = f"size {size} != manifest {shard['shard_bytes']}"
        elif change is None:
            to_hash[shard["shard_id"]] = None  # nothing would show the next change: never remembered
        else:
            identity = _identity(url, size, change, shard["shard_sha256"])
            if identity not in known:
                to_hash[shard["shard_id"]] = identity
    if to_hash:
        import pyarrow.compute as pc

        subset = manifest.filter(pc.is_in(manifest["shard_id"], pa.array(list(to_hash))))
        report = verify_shards(store, subset)
        bad.update({b.shard_id: b.reason for b in report.bad})
        with _lock:
            passed = {identity for sid, identity in to_hash.items() if identity and sid not in bad}
            known = _load(record) | passed
            _save(record, known)
    return bad
