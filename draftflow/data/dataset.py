"""The prepared dataset on storage: its schema, atomic writes, and the loaders other stages use.

Files (paths from :class:`draftflow.paths.DataLayout`): ``samples.parquet`` (one row per
sample, :data:`SAMPLES_SCHEMA`), ``token_counts.parquet`` (loss-masked train token
frequencies) and ``report.json``. The report is written last; a folder without it was never
finished and is not read.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draftflow.data.sources import Conversation
from draftflow.paths import DataLayout

log = logging.getLogger(__name__)

TRAIN, EVAL = "train", "eval"

SAMPLES_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("split", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),
    ("num_tokens", pa.int32()),
    ("num_loss_tokens", pa.int32()),
    ("source", pa.string()),
    ("messages", pa.string()),
])
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


def atomic_write(url: str, storage_options: dict | None, write: Callable[[Any], None]) -> None:
    """Write through ``write(file)`` to a temporary sibling, then move it onto ``url``.

    Local: the move is a rename within the folder. Object stores: the final key is created
    by one copy of a complete object. Either way readers see the old state or the whole file.
    """
    fs, path = _fs(url, storage_options)
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    temporary = f"{path}.partial-{uuid.uuid4().hex[:12]}"
    try:
        with fs.open(temporary, "wb") as f:
            write(f)
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
        raise FileNotFoundError(f"no complete prepared data in {layout.prepared_dir} (never prepared, or interrupted)")
    fs, path = _fs(layout.samples, storage_options)
    filters = [("split", "=", split)] if split else None
    return pq.read_table(path, filesystem=fs, filters=filters, schema=SAMPLES_SCHEMA, columns=columns)


def load_token_counts(layout: DataLayout, storage_options: dict | None = None) -> dict[int, int]:
    fs, path = _fs(layout.token_counts, storage_options)
    table = pq.read_table(path, filesystem=fs)
    return dict(zip(table["token_id"].to_pylist(), table["count"].to_pylist()))


def eval_prompts(layout: DataLayout, limit: int | None = None, storage_options: dict | None = None) -> list[EvalPrompt]:
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
            values = rows[column.name][lo: lo + _ROWS_PER_BATCH]
            if pa.types.is_list(column.type):
                offsets = np.zeros(len(values) + 1, dtype=np.int32)
                np.cumsum([len(v) for v in values], out=offsets[1:])
                flat = pa.array(np.concatenate(values), column.type.value_type)
                columns.append(pa.ListArray.from_arrays(pa.array(offsets), flat))
            else:
                columns.append(pa.array(values, column.type))
        batches.append(pa.RecordBatch.from_arrays(columns, schema=SAMPLES_SCHEMA))
    return pa.Table.from_batches(batches, schema=SAMPLES_SCHEMA)

