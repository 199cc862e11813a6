"""The prepared dataset on storage: its schema, atomic writes, and the loaders other stages use.

Files (paths from :class:`draftflow.paths.DataLayout`): ``samples.parquet`` (one row per
sample, :data:`SAMPLES_SCHEMA`), ``token_counts.parquet`` (loss-masked train token
frequencies) and ``report.json``. The report is written last; a folder without it was never
finished and is not read.

The folder is written once (a second preparation on the same fingerprint never rewrites it,
:func:`publish_prepared`), and the report records the sha256 of both tables, checked when
they are loaded (once per process and file version), so a flipped bit is an error, not data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from draftflow.data.sources import Conversation
from draftflow.paths import DataLayout

log = logging.getLogger(__name__)

TRAIN, EVAL = "train", "eval"

SAMPLES_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("split", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("source", pa.string()),
        ("messages", pa.string()),
    ]
)
TOKEN_COUNTS_SCHEMA = pa.schema([("token_id", pa.int32()), ("count", pa.int64())])
_ROWS_PER_BATCH = 8192  # x max_length tokens must stay below 2**31 (int32 list offsets)


@dataclass(frozen=True)
class EvalPrompt:
    """One held-out prompt for acceptance evaluation."""

    sample_id: str
    messages: Conversation  # system/user turns up to the first assistant turn


def prompt_messages(messages: Conversation) -> Conversation:
    """The messages before the first assistant turn: the prompt a target answers in evaluation."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out


def _fs(url: str, storage_options: dict | None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def atomic_write(
    url: str, storage_options: dict | None, write: Callable[[Any], None], *, exclusive: bool = False
) -> None:
    """Write through ``write(file)`` to a temporary sibling, then move it onto ``url``.

    Local: the move is a rename within the folder. Object stores: the final key is created
    by one copy of a complete object. Either way readers see the old state or the whole file.
    ``exclusive``: never replace an existing ``url`` (FileExistsError): locally a hard link,
    atomic; on object stores an existence check just before the copy (a window of one request).
    """
    fs, path = _fs(url, storage_options)
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    temporary = f"{path}.partial-{uuid.uuid4().hex[:12]}"
    try:
        with fs.open(temporary, "wb") as f:
            write(f)
        if exclusive and isinstance(fs, LocalFileSystem):
            os.link(temporary, path)  # FileExistsError when another writer got there first
            fs.rm(temporary)
        elif exclusive and fs.exists(path):
            raise FileExistsError(url)
        else:
            fs.mv(temporary, path)
    except BaseException:
        try:
            if fs.exists(temporary):
                fs.rm(temporary)
        except Exception:  # cleanup must not hide the original error
            log.warning("could not remove temporary file %s", temporary)
        raise


def write_parquet(url: str, table: pa.Table, storage_options: dict | None) -> None:
    atomic_write(url, storage_options, lambda f: pq.write_table(table, f, compression="zstd"))


class CorruptPreparedData(ValueError):
    """A prepared file does not match the checksum its report recorded; the message says how to redo it."""


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def publish_prepared(
    layout: DataLayout,
    samples: pa.Table,
    counts: pa.Table,
    report: dict,
    storage_options: dict | None,
    wait_s: float = 60.0,
) -> tuple[dict, bool]:
    """Write the prepared folder once; returns (the folder's report, whether this call wrote it).

    Each file is created exclusively, samples first and the report (with both tables' sha256)
    last. A preparation that finds samples.parquet already there lost the race to another one
    on the same fingerprint (whose extraction may be reading it): it never rewrites it, it
    waits up to ``wait_s`` for that one's report and returns it. Only a samples file older than
    ``wait_s`` with no report beside it, left by a preparation that died, is replaced.
    """
    blobs = {layout.samples: parquet_bytes(samples), layout.token_counts: parquet_bytes(counts)}
    files = {
        url.rsplit("/", 1)[1]: {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)}
        for url, b in blobs.items()
    }
    report = {**report, "files": files}
    report_blob = json.dumps(report, indent=2, sort_keys=True).encode("utf-8")
    for attempt in range(2):
        try:
            for url, blob in blobs.items():
                atomic_write(url, storage_options, lambda f, b=blob: f.write(b), exclusive=True)
            atomic_write(
                layout.prepare_report, storage_options, lambda f: f.write(report_blob), exclusive=True
            )
            return report, True
        except FileExistsError:
            if _await_report(layout, storage_options, wait_s) or attempt:
                return read_report(layout, storage_options), False
            log.warning(
                "%s: removing the files of a preparation that died before its report", layout.prepared_dir
            )
            for url in blobs:
                fs, path = _fs(url, storage_options)
                if fs.exists(path):
                    fs.rm(path)
    raise AssertionError("unreachable")


def _await_report(layout: DataLayout, storage_options: dict | None, wait_s: float) -> bool:
    """True once the report shows; False when none came and samples.parquet is older than ``wait_s``."""
    fs, report_path = _fs(layout.prepare_report, storage_options)
    _, samples_path = _fs(layout.samples, storage_options)
    while True:
        fs.invalidate_cache()
        if fs.exists(report_path):
            return True
        try:
            age = time.time() - fs.modified(samples_path).timestamp()
        except FileNotFoundError:
            age = 0.0  # removed meanwhile: the other writer is retrying; wait for its report
        if age > wait_s:
            return False
        time.sleep(1.0)


_verified: dict[tuple, str] = {}  # (url, size, mtime) -> sha256 already checked in this process


def _verify(url: str, report: dict, storage_options: dict | None) -> None:
    expected = (report.get("files") or {}).get(url.rsplit("/", 1)[1])
    if expected is None:  # a folder prepared before checksums were recorded: nothing to compare
        return
    fs, path = _fs(url, storage_options)
    info = fs.info(path)
    key = (url, int(info.get("size") or 0), str(info.get("mtime") or info.get("LastModified") or ""))
    if _verified.get(key) == expected["sha256"]:
        return
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != expected["sha256"]:
        raise CorruptPreparedData(
            f"{url}: sha256 {digest.hexdigest()[:16]}… differs from {expected['sha256'][:16]}… recorded in "
            f"report.json: the prepared data is corrupt; delete {url.rsplit('/', 1)[0]} and prepare again "
            "(`draftflow extract` or the prepare flow), then re-extract its shards"
        )
    _verified[key] = expected["sha256"]


def is_prepared(layout: DataLayout, storage_options: dict | None = None) -> bool:
    """True when all three outputs exist (the report, written last, marks completion)."""
    for url in (layout.prepare_report, layout.samples, layout.token_counts):
        fs, path = _fs(url, storage_options)
        if not fs.exists(path):
            return False
    return True


def read_report(layout: DataLayout, storage_options: dict | None = None) -> dict:
    with fsspec.open(layout.prepare_report, "r", encoding="utf-8", **(storage_options or {})) as f:
        return json.load(f)


def load_prepared(
    layout: DataLayout,
    split: str | None = None,
    storage_options: dict | None = None,
    columns: list[str] | None = None,
) -> pa.Table:
    """The samples table (schema :data:`SAMPLES_SCHEMA`), optionally only one split and some columns.

    ``columns`` lets extraction skip the message text, the largest column after the tokens.
    """
    if split not in (None, TRAIN, EVAL):
        raise ValueError(f"split must be {TRAIN!r}, {EVAL!r} or None, not {split!r}")
    if not is_prepared(layout, storage_options):
        raise FileNotFoundError(
            f"no complete prepared data in {layout.prepared_dir} (never prepared, or interrupted)"
        )
    _verify(layout.samples, read_report(layout, storage_options), storage_options)
    fs, path = _fs(layout.samples, storage_options)
    filters = [("split", "=", split)] if split else None
    return pq.read_table(path, filesystem=fs, filters=filters, schema=SAMPLES_SCHEMA, columns=columns)


def load_token_counts(layout: DataLayout, storage_options: dict | None = None) -> dict[int, int]:
    _verify(layout.token_counts, read_report(layout, storage_options), storage_options)
    fs, path = _fs(layout.token_counts, storage_options)
    table = pq.read_table(path, filesystem=fs)
    return dict(zip(table["token_id"].to_pylist(), table["count"].to_pylist()))


def eval_prompts(
    layout: DataLayout, limit: int | None = None, storage_options: dict | None = None
) -> list[EvalPrompt]:
    """Prompts of the held-out eval split (messages up to the first assistant turn), in split order."""
    table = load_prepared(layout, EVAL, storage_options).select(["sample_id", "messages"])
    rows = table.to_pylist()[:limit] if limit is not None else table.to_pylist()
    return [EvalPrompt(r["sample_id"], prompt_messages(json.loads(r["messages"]))) for r in rows]


def loss_token_counts(input_ids: list[list[int]], loss_masks: list[list[int]]) -> dict[int, int]:
    """How often each token id appears where the loss mask is 1."""
    if not input_ids:
        return {}
    ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids])
    mask = np.concatenate([np.asarray(m, dtype=bool) for m in loss_masks])
    values, counts = np.unique(ids[mask], return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


def samples_table(rows: dict[str, list]) -> pa.Table:
    """Rows → Arrow, in record batches small enough for 32-bit list offsets."""
    batches = []
    for lo in range(0, len(rows["sample_id"]), _ROWS_PER_BATCH):
        columns = []
        for column in SAMPLES_SCHEMA:
            values = rows[column.name][lo : lo + _ROWS_PER_BATCH]
            if pa.types.is_list(column.type):
                offsets = np.zeros(len(values) + 1, dtype=np.int32)
                np.cumsum([len(v) for v in values], out=offsets[1:])
                flat = pa.array(np.concatenate(values), column.type.value_type)
                columns.append(pa.ListArray.from_arrays(pa.array(offsets), flat))
            else:
                columns.append(pa.array(values, column.type))
        batches.append(pa.RecordBatch.from_arrays(columns, schema=SAMPLES_SCHEMA))
    return pa.Table.from_batches(batches, schema=SAMPLES_SCHEMA)
