"""The few storage operations the store needs, the same on every fsspec backend.

Only three primitives carry the commit protocol, and each is atomic on every backend:

* :func:`write_atomic` — an object appears complete under its final name or not at all.
  Local disks (``/…``, ``file://``, ``/dev/shm``): write a hidden temp file in the same
  folder, fsync, ``os.replace`` (atomic within one filesystem), fsync the folder. Object
  stores: one streamed upload; S3 makes the object visible only when the PUT or the
  CompleteMultipartUpload succeeds, and on an error the upload is aborted, never completed.
* listing a folder — a reader never sees an object that is still being written.
* deleting one object.

No locks, no renames on object stores, no conditional writes: that is what lets the same code
run on S3, GCS, Azure, NFS and /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from draftflow import paths
from draftflow.paths import DataLayout

# Streamed reads (checksums) use this chunk size: large enough for object stores, small in RAM.
READ_CHUNK = 8 << 20


def new_token() -> str:
    """A random token naming one write (the `writer` of a shard, a temp file, a compaction)."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Entry:
    """One object found by :meth:`Store.list`."""

    name: str
    url: str
    size: int
    modified: float  # seconds since the epoch, from the backend's clock


@dataclass(frozen=True)
class Store:
    """One fingerprinted data folder on some fsspec backend, with the options to reach it."""

    layout: DataLayout
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)  # holds credentials

    @classmethod
    def at(cls, root: str, storage_options: dict[str, Any] | None = None) -> Store:
        return cls(DataLayout(root), dict(storage_options or {}))

    def fs(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        # fsspec caches filesystem instances per options, so this is cheap to call per object.
        return fsspec.core.url_to_fs(url, **self.storage_options)

    def is_local(self) -> bool:
        return isinstance(self.fs(self.layout.root)[0], LocalFileSystem)

    def list(self, folder: str, suffix: str = "", *, include_temp: bool = False) -> list[Entry]:
        """Objects directly in ``folder`` whose name ends with ``suffix``, sorted by name.

        Listings are never served from a cache (s3fs keeps one), because the protocol's whole
        point is to see what other writers committed a moment ago.
        """
        fs, path = self.fs(folder)
        fs.invalidate_cache(path)
        try:
            infos = fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for info in infos:
            if info.get("type") != "file":
                continue
            name = info["name"].rstrip("/").rpartition("/")[2]
            if not name.endswith(suffix) or (paths.is_temp_name(name) and not include_temp):
                continue
            out.append(Entry(name, paths.join(folder, name), int(info.get("size") or 0), _mtime(fs, info)))
        return sorted(out, key=lambda e: e.name)

    def size(self, url: str) -> int:
        fs, path = self.fs(url)
        return int(fs.size(path))

    def read_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object: one ranged GET on object stores, seek+read locally."""
        fs, path = self.fs(url)
        data = fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise EOFError(f"{url}: wanted bytes [{start}, {end}), got {len(data)}")
        return data

    def read_all(self, url: str) -> bytes:
        fs, path = self.fs(url)
        return fs.cat_file(path)

    def read_many(self, urls: list[str]) -> dict[str, bytes | Exception]:
        """Whole objects, fetched concurrently where the backend can; errors are returned, not raised."""
        if not urls:
            return {}
        fs, _ = self.fs(urls[0])
        by_path = {self.fs(u)[1]: u for u in urls}
        got = fs.cat(list(by_path), on_error="return")
        if not isinstance(got, dict):  # one path: fsspec returns the bytes themselves
            got = {next(iter(by_path)): got}
        return {by_path[p]: v for p, v in got.items()}

    def iter_chunks(self, url: str) -> Iterator[bytes]:
        fs, path = self.fs(url)
        with fs.open(path, "rb", block_size=READ_CHUNK, cache_type="none") as f:
            while chunk := f.read(READ_CHUNK):
                yield chunk

    def delete(self, url: str) -> None:
        fs, path = self.fs(url)
        with contextlib.suppress(FileNotFoundError):  # a concurrent gc or compaction got there first
            fs.rm_file(path)

    def write_atomic(self, url: str, write: Callable[[IO[bytes]], Any]) -> Any:
        """Run ``write(file)`` so that ``url`` becomes visible complete or not at all; returns its result."""
        fs, path = self.fs(url)
        if isinstance(fs, LocalFileSystem):
            return _write_local(path, write)
        fs.makedirs(fs._parent(path), exist_ok=True)
        f = fs.open(path, "wb")
        try:
            result = write(f)
        except BaseException:
            # fsspec's close() (also run by __exit__ and __del__) would *commit* what was
            # buffered so far; discard aborts the upload and marking it closed stops __del__.
            f.discard()
            f.closed = True
            raise
        f.close()
        return result


def _write_local(path: str, write: Callable[[IO[bytes]], Any]) -> Any:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = paths.temp_sibling(path, new_token())
    try:
        with open(tmp, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())  # data on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power loss
    finally:
        os.close(dir_fd)
    return result


def _mtime(fs: fsspec.AbstractFileSystem, info: dict) -> float:
    for key in ("LastModified", "mtime", "last_modified", "updated"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
    return fs.modified(info["name"]).timestamp()
