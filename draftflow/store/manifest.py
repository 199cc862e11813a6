"""The Arrow manifest: which samples exist, in which shard, at which bytes.

One table, one row per sample of every committed shard, successful or failed. Shard-level
fields (uri, size, checksum, writer, extraction settings) repeat on each row of the shard:

* a fragment is then *one* Arrow IPC file, written with one atomic PUT or rename, so a shard's
  rows and its shard-level facts can never be half-committed or disagree;
* every reader (trainer, reconcile, ``ls``) needs the shard fields next to the sample fields,
  and gets them without a join;
* the repetition costs little: files are zstd-compressed, and the manifest stays tiny next
  to the hidden states it describes (hundreds of bytes per sample vs. megabytes).

Failed samples are rows with ``status = "failed"`` and a ``failure_reason`` in the same
fragment as the shard's good samples: the outcome of one shard attempt is committed atomically,
and a retry that succeeds supersedes it as a whole (see :func:`resolve`).

Several fragments may exist for one shard id (two runs raced, or a retry). :func:`resolve`
keeps exactly one per shard id: highest ``attempt``, then earliest ``created_at``, then lowest
``writer``. That is a total order, so the winner does not depend on listing order, and
resolving a compacted (already resolved) table together with newer fragments gives the same
answer as resolving everything at once — which is what makes compaction safe.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc

from draftflow import paths
from draftflow.store.backend import Store, new_token
from draftflow.store.shard import stored_dtypes

STATUS_OK = "ok"
STATUS_FAILED = "failed"
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")
_READ_RETRIES = 5

SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("shard_id", pa.string(), nullable=False),
        pa.field("index_in_shard", pa.int32(), nullable=False),
        pa.field("status", pa.string(), nullable=False),  # "ok" | "failed"
        pa.field("failure_reason", pa.string()),
        pa.field("num_tokens", pa.int32()),
        pa.field("num_loss_tokens", pa.int32()),
        pa.field("token_dtype", pa.string()),
        pa.field("token_ids_offset", pa.int64()),  # absolute offsets inside the shard object
        pa.field("token_ids_length", pa.int64()),
        pa.field("hidden_states_offset", pa.int64()),
        pa.field("hidden_states_length", pa.int64()),
        pa.field("loss_mask_offset", pa.int64()),
        pa.field("loss_mask_length", pa.int64()),
        pa.field("sample_sha256", pa.string()),  # of bytes [token_ids_offset, loss_mask end)
        pa.field("shard_uri", pa.string(), nullable=False),  # relative to the data folder
        pa.field("shard_bytes", pa.int64(), nullable=False),
        pa.field("shard_sha256", pa.string(), nullable=False),
        pa.field("shard_format", pa.int32(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("layer_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("hidden_size", pa.int32(), nullable=False),
        pa.field("target", pa.string(), nullable=False),
        pa.field("target_revision", pa.string()),
        pa.field("mode", pa.string(), nullable=False),  # "offline" | "online"
        pa.field("vllm_version", pa.string()),
        pa.field("writer", pa.string(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


@dataclass(frozen=True)
class ExtractionInfo:
    """What produced a shard's hidden states; repeated on every manifest row of the shard."""

    dtype: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    target: str
    target_revision: str | None = None
    mode: Literal["offline", "online"] = "offline"
    vllm_version: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in stored_dtypes():
            raise ValueError(f"dtype must be one of {sorted(stored_dtypes())}, got {self.dtype!r}")
        if self.mode not in ("offline", "online"):
            raise ValueError(f"mode must be 'offline' or 'online', got {self.mode!r}")
        if not self.layer_ids or self.hidden_size < 1:
            raise ValueError("layer_ids must be non-empty and hidden_size >= 1")


def to_ipc_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema, options=_IPC_OPTIONS) as writer:
        writer.write_table(table)
    return sink.getvalue()


def from_ipc_bytes(data: bytes) -> pa.Table:
    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    missing = [f.name for f in SCHEMA if f.name not in table.column_names and not f.nullable]
    if missing:
        raise ValueError(f"manifest table lacks required columns {missing}")
    # Columns added by a later version are nullable, so older files conform with nulls.
    columns = [
        table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
        for f in SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def empty() -> pa.Table:
    return SCHEMA.empty_table()


def read_raw(store: Store) -> pa.Table:
    """Every row of every compacted table and fragment, unresolved (duplicates and losers kept)."""
    layout = store.layout
    for _ in range(_READ_RETRIES):
        # Fragments are listed before compacted tables: a compaction that runs in between
        # deletes fragments only after writing its table, so either we read the fragment or
        # the second listing sees the table. A file deleted after listing means a compaction
        # ran: list again.
        fragment_urls = [e.url for e in store.list(layout.fragments_dir, paths.ARROW_SUFFIX)]
        compacted_urls = [e.url for e in store.list(layout.compacted_dir, paths.ARROW_SUFFIX)]
        got = store.read_many(compacted_urls + fragment_urls)
        if any(isinstance(v, FileNotFoundError) for v in got.values()):
            continue
        for url, value in got.items():
            if isinstance(value, Exception):
                raise OSError(f"cannot read manifest file {url}: {value}") from value
        tables = [from_ipc_bytes(got[u]) for u in compacted_urls + fragment_urls]
        return pa.concat_tables(tables) if tables else empty()
    raise OSError(f"manifest of {layout.root} kept changing while being read ({_READ_RETRIES} tries)")


def resolve(table: pa.Table) -> pa.Table:
    """One fragment per shard id (see module docstring), each row once, sorted by shard and index."""
    if len(table) == 0:
        return table
    commits = (
        table.select(["shard_id", "writer", "attempt", "created_at"])
        .group_by(["shard_id", "writer", "attempt", "created_at"])
        .aggregate([])
    )
    best: dict[str, tuple] = {}
    for row in commits.to_pylist():
        rank = (-row["attempt"], row["created_at"], row["writer"])
        if row["shard_id"] not in best or rank < best[row["shard_id"]][0]:
            best[row["shard_id"]] = (rank, row["writer"])
    winners = pa.table({"shard_id": list(best), "writer": [w for _, w in best.values()]})
    # Join a narrow key table only: Arrow joins cannot carry list columns such as layer_ids.
    keys = table.select(["shard_id", "writer", "index_in_shard"])
    keys = keys.append_column("_row", pa.array(range(len(table)), pa.int64()))
    kept = keys.join(winners, ["shard_id", "writer"], join_type="inner")
    # A fragment can be both in a compacted table and still in place (compaction crashed
    # before deleting it): keep the first copy of each (shard, writer, index).
    first = kept.group_by(["shard_id", "writer", "index_in_shard"]).aggregate([("_row", "min")])
    out = table.take(first["_row_min"])
    return out.sort_by([("shard_id", "ascending"), ("index_in_shard", "ascending")])


def read_manifest(store: Store, *, resolved: bool = True) -> pa.Table:
    """The manifest as readers see it: compacted tables + fragments, resolved unless asked not to."""
    raw = read_raw(store)
    return resolve(raw) if resolved else raw


def write_fragment(store: Store, table: pa.Table) -> str:
    """Commit one shard attempt's rows as an immutable fragment; returns its URL."""
    shard_ids = set(table["shard_id"].to_pylist())
    writers = set(table["writer"].to_pylist())
    if len(shard_ids) != 1 or len(writers) != 1:
        raise ValueError("a fragment holds the rows of exactly one shard attempt")
    url = store.layout.fragment(shard_ids.pop(), writers.pop())
    data = to_ipc_bytes(table.cast(SCHEMA))
    store.write_atomic(url, lambda f: f.write(data))
    return url


def compact(store: Store) -> str | None:
    """Merge fragments into one compacted table, then delete what was merged.

    Order matters for crash safety: the new table is complete before anything is deleted,
    and readers resolve duplicates, so a crash at any point loses nothing. Running it again
    (or concurrently) is harmless. Losing fragments of a shard are dropped, which leaves their
    shard objects unreferenced for :func:`draftflow.store.writer.gc`. Returns the new table's
    URL, or None when there was nothing to merge.
    """
    layout = store.layout
    fragments = store.list(layout.fragments_dir, paths.ARROW_SUFFIX)
    compacted = store.list(layout.compacted_dir, paths.ARROW_SUFFIX)
    if not fragments and len(compacted) <= 1:
        return None
    got = store.read_many([e.url for e in compacted + fragments])
    # A file that vanished was merged by a concurrent compaction into a table written before
    # the deletion; that table is either listed here or left in place (only what is listed
    # here is deleted), so skipping the vanished file loses nothing.
    inputs = [e for e in compacted + fragments if not isinstance(got[e.url], FileNotFoundError)]
    for entry in inputs:
        if isinstance(got[entry.url], Exception):
            raise OSError(f"cannot read manifest file {entry.url}: {got[entry.url]}") from got[entry.url]
    raw = pa.concat_tables([empty()] + [from_ipc_bytes(got[e.url]) for e in inputs])
    merged = resolve(raw)
    stamp = f"{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}-{new_token()}"
    # Shards this compaction stops referencing (losing commits): recorded before the merge is
    # visible, so gc's grace for them starts now, not at their (possibly old) upload.
    dropped = sorted(set(raw["shard_uri"].to_pylist()) - set(merged["shard_uri"].to_pylist()))
    if dropped:
        record = json.dumps({"shard_uris": dropped}).encode()
        store.write_atomic(layout.dropped_record(stamp), lambda f: f.write(record))
    url = layout.compacted(stamp)
    data = to_ipc_bytes(merged)
    store.write_atomic(url, lambda f: f.write(data))
    for entry in inputs:
        store.delete(entry.url)
    return url


@dataclass(frozen=True)
class StoreSummary:
    """What ``draftflow store ls`` prints."""

    root: str
    fragments: int
    compacted_tables: int
    shards: int
    superseded_fragments: int
    samples_ok: int
    samples_failed: int
    duplicate_sample_ids: int
    tokens: int
    loss_tokens: int
    shard_bytes: int
    orphan_objects: int
    dtypes: tuple[str, ...]
    targets: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join(
            [
                f"store      {self.root}",
                f"manifest   {self.fragments} fragments, {self.compacted_tables} compacted tables, "
                f"{self.superseded_fragments} superseded fragments",
                f"shards     {self.shards} ({self.shard_bytes / 2**30:.2f} GiB), "
                f"{self.orphan_objects} orphan objects",
                f"samples    {self.samples_ok} ok, {self.samples_failed} failed, "
                f"{self.duplicate_sample_ids} duplicate ids",
                f"tokens     {self.tokens} ({self.loss_tokens} with loss)",
                f"dtype      {', '.join(self.dtypes) or '-'}; target {', '.join(self.targets) or '-'}",
            ]
        )


def ls(store: Store) -> StoreSummary:
    """Summary of a data folder: manifest files, shards, samples, tokens, orphans."""
    layout = store.layout
    objects = {e.url for e in store.list(layout.shards_dir, paths.SHARD_SUFFIX)}
    fragments = len(store.list(layout.fragments_dir, paths.ARROW_SUFFIX))
    compacted = len(store.list(layout.compacted_dir, paths.ARROW_SUFFIX))
    raw = read_raw(store)
    table = resolve(raw)
    referenced = {layout.resolve_shard_key(key) for key in pc.unique(raw["shard_uri"]).to_pylist()}
    commits = len(raw.select(["shard_id", "writer"]).group_by(["shard_id", "writer"]).aggregate([]))
    ok = table.filter(pc.equal(table["status"], STATUS_OK))
    shards = table.group_by(["shard_id"]).aggregate([("shard_bytes", "max")])
    id_counts = Counter(ok["sample_id"].to_pylist())
    return StoreSummary(
        root=layout.root,
        fragments=fragments,
        compacted_tables=compacted,
        shards=len(shards),
        superseded_fragments=commits - len(shards),
        samples_ok=len(ok),
        samples_failed=len(table) - len(ok),
        duplicate_sample_ids=sum(n - 1 for n in id_counts.values()),
        tokens=int(pc.sum(ok["num_tokens"]).as_py() or 0),
        loss_tokens=int(pc.sum(ok["num_loss_tokens"]).as_py() or 0),
        shard_bytes=int(pc.sum(shards["shard_bytes_max"]).as_py() or 0),
        orphan_objects=len(objects - referenced),
        dtypes=tuple(sorted(set(table["dtype"].to_pylist()))),
        targets=tuple(sorted(set(table["target"].to_pylist()))),
    )
