"""Committing shards, crash-safe on any fsspec backend and without locks; and garbage collection.

The commit protocol of :func:`write_shard`:

1. The shard object is written completely under a name no one else uses,
   ``shards/SHARD-WRITER.safetensors`` with a fresh random ``WRITER`` token per call
   (:meth:`Store.write_atomic`: temp + rename locally, one atomic PUT/multipart upload on
   object stores).
2. Only then is the shard's manifest fragment written, the same way. The fragment is the
   commit record: readers find shards through fragments only, so a shard object without one
   (the writer died between the steps) is invisible, and :func:`gc` deletes it once it is
   older than a grace period.

Every name is unique and every object immutable, so two runs writing the same shard at the
same time both succeed without touching each other's objects; the manifest then holds two
fragments for that shard id and readers pick one deterministically
(:func:`draftflow.store.manifest.resolve`). A SIGKILL at any instant leaves either nothing,
an invisible temp file / aborted upload, an invisible orphan, or a complete commit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa

from draftflow import paths
from draftflow.store.backend import Store, new_token
from draftflow.store.manifest import (
    SCHEMA,
    STATUS_FAILED,
    STATUS_OK,
    ExtractionInfo,
    read_raw,
    write_fragment,
)
from draftflow.store.shard import (
    FORMAT,
    FORMAT_VERSION,
    Sample,
    WrittenShard,
    token_dtype_name,
    write_shard_stream,
)

# A writer gives up (leaving an orphan) rather than commit a shard whose upload began longer
# ago than this; gc's grace period must be longer, or gc could delete a shard that is just
# about to be committed.
COMMIT_DEADLINE_S = 3600.0
GC_GRACE_S = 6 * 3600.0
# Clocks of writers, compactors and the store may disagree by this much; gc never goes below
# the commit deadline plus this margin.
CLOCK_SKEW_MARGIN_S = 600.0
MIN_GC_GRACE_S = COMMIT_DEADLINE_S + CLOCK_SKEW_MARGIN_S


class CommitTooLate(RuntimeError):
    """The shard took longer than the commit deadline; it was left uncommitted for gc."""


class ManifestEmpty(RuntimeError):
    """gc found shard objects to delete but a manifest that lists none; nothing was deleted."""


@dataclass(frozen=True)
class FailedSample:
    """A sample that could not be extracted; recorded in the shard's fragment with its reason."""

    sample_id: str
    reason: str
    num_tokens: int | None = None


@dataclass(frozen=True)
class CommittedShard:
    """The outcome of one :func:`write_shard` call."""

    shard_id: str
    writer: str
    attempt: int
    shard_url: str
    fragment_url: str
    sha256: str
    nbytes: int
    samples_ok: int
    samples_failed: int


def write_shard(
    store: Store,
    shard_id: str,
    samples: Sequence[Sample | FailedSample],
    info: ExtractionInfo,
    *,
    attempt: int = 1,
    commit_deadline_s: float = COMMIT_DEADLINE_S,
) -> CommittedShard:
    """Write one shard object, then commit its manifest fragment (see module docstring).

    ``samples`` are the shard's samples in order (failures included, at their position);
    ``attempt`` is the number :func:`draftflow.store.reconcile.reconcile` planned, so that a
    retry supersedes an earlier incomplete or corrupt commit of the same shard id.
    """
    writer = new_token()
    layout = store.layout
    shard_url = layout.shard(shard_id, writer)  # rejects unsafe ids before anything is written
    ids = [s.sample_id for s in samples]
    if not ids:
        raise ValueError(f"shard {shard_id}: no samples (a fragment records at least one outcome)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"shard {shard_id}: duplicate sample ids")
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    good = [(i, s) for i, s in enumerate(samples) if isinstance(s, Sample)]
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "shard_id": shard_id,
        "writer": writer,
        "attempt": str(attempt),
        "sample_ids": json.dumps({str(i): s.sample_id for i, s in good}),
        "dtype": info.dtype,
        "layer_ids": json.dumps(list(info.layer_ids)),
        "hidden_size": str(info.hidden_size),
        "target": info.target,
        "target_revision": info.target_revision or "",
        "mode": info.mode,
        "vllm_version": info.vllm_version or "",
    }
    started = time.monotonic()
    written: WrittenShard = store.write_atomic(
        shard_url,
        lambda f: write_shard_stream(
            f,
            good,
            dtype=info.dtype,
            n_layers=len(info.layer_ids),
            hidden_size=info.hidden_size,
            metadata=metadata,
        ),
    )
    if time.monotonic() - started > commit_deadline_s:
        raise CommitTooLate(
            f"shard {shard_id} took over {commit_deadline_s:.0f}s; left for gc, not committed"
        )
    rows = _fragment_rows(
        layout.shard_key(shard_id, writer), shard_id, writer, attempt, samples, written, info
    )
    fragment_url = write_fragment(store, rows)
    return CommittedShard(
        shard_id,
        writer,
        attempt,
        shard_url,
        fragment_url,
        written.sha256,
        written.nbytes,
        len(good),
        len(samples) - len(good),
    )


def _fragment_rows(
    shard_key: str,
    shard_id: str,
    writer: str,
    attempt: int,
    samples: Sequence[Sample | FailedSample],
    written: WrittenShard,
    info: ExtractionInfo,
) -> pa.Table:
    created_at = datetime.now(UTC)
    spans = iter(zip(written.spans, written.sample_sha256, strict=True))
    rows = []
    for index, sample in enumerate(samples):
        row = {
            "sample_id": sample.sample_id,
            "shard_id": shard_id,
            "index_in_shard": index,
            "shard_uri": shard_key,
            "shard_bytes": written.nbytes,
            "shard_sha256": written.sha256,
            "shard_format": FORMAT_VERSION,
            "dtype": info.dtype,
            "layer_ids": list(info.layer_ids),
            "hidden_size": info.hidden_size,
            "target": info.target,
            "target_revision": info.target_revision,
            "mode": info.mode,
            "vllm_version": info.vllm_version,
            "writer": writer,
            "attempt": attempt,
            "created_at": created_at,
        }
        if isinstance(sample, FailedSample):
            row.update(status=STATUS_FAILED, failure_reason=sample.reason, num_tokens=sample.num_tokens)
        else:
            span, sample_sha = next(spans)
            row.update(
                status=STATUS_OK,
                num_tokens=sample.num_tokens,
                num_loss_tokens=int(sample.loss_mask.sum()),
                token_dtype=token_dtype_name(sample.token_ids.dtype),
                sample_sha256=sample_sha,
                token_ids_offset=span.token_ids.offset,
                token_ids_length=span.token_ids.length,
                hidden_states_offset=span.hidden_states.offset,
                hidden_states_length=span.hidden_states.length,
                loss_mask_offset=span.loss_mask.offset,
                loss_mask_length=span.loss_mask.length,
            )
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=SCHEMA)


@dataclass(frozen=True)
class GcReport:
    """What :func:`gc` deleted (or would delete, with ``dry_run``)."""

    orphan_shards: tuple[str, ...]
    temp_files: tuple[str, ...]
    young_orphans_kept: int


def gc(
    store: Store,
    *,
    grace_s: float = GC_GRACE_S,
    dry_run: bool = False,
    now: float | None = None,
    force: bool = False,
) -> GcReport:
    """Delete shard objects no fragment references, and leftover temp files, older than ``grace_s``.

    Objects are listed *before* the manifest is read: a shard committed in between is then
    seen as referenced. The grace counts from when an object stopped being referenced: for a
    shard whose commit lost (dropped by :func:`draftflow.store.manifest.compact`), from that
    compaction (its dropped record), since a trainer that read the manifest before may still
    read it; for a shard never committed, from its upload, so a writer within its commit
    deadline keeps it. Every age is measured on the store's clock (``now`` defaults to the
    modification time of an object written just now), so a skewed host clock changes nothing.
    ``grace_s`` below :data:`MIN_GC_GRACE_S` is refused, and so (:class:`ManifestEmpty`, unless
    ``force``) is deleting shard objects when the manifest lists no shard at all: a lost or
    unreadable manifest would otherwise make every shard an orphan.
    """
    if grace_s < MIN_GC_GRACE_S:
        raise ValueError(
            f"gc grace {grace_s:.0f}s is below the minimum {MIN_GC_GRACE_S:.0f}s (writers' commit deadline "
            f"{COMMIT_DEADLINE_S:.0f}s + clock-skew margin {CLOCK_SKEW_MARGIN_S:.0f}s): a shard uploaded but not "
            "yet committed, or one a running trainer still reads, could be deleted"
        )
    layout = store.layout
    objects = store.list(layout.shards_dir, paths.SHARD_SUFFIX)
    temps = [
        e
        for folder in (layout.shards_dir, layout.fragments_dir, layout.compacted_dir)
        for e in store.list(folder, paths.TEMP_SUFFIX, include_temp=True)
        if paths.is_temp_name(e.name)
    ]
    records = store.list(layout.compacted_dir, paths.DROPPED_SUFFIX)
    dropped_at: dict[str, float] = {}
    dropped_by: dict[str, list[str]] = {}
    for record in records:
        uris = json.loads(store.read_all(record.url))["shard_uris"]
        dropped_by[record.url] = [layout.resolve_shard_key(u) for u in uris]
        for url in dropped_by[record.url]:
            dropped_at[url] = max(dropped_at.get(url, 0.0), record.modified)
    referenced = {layout.resolve_shard_key(key) for key in set(read_raw(store)["shard_uri"].to_pylist())}
    now = store_clock(store) if now is None else now
    orphans = [e for e in objects if e.url not in referenced]
    old_orphans = [e for e in orphans if now - max(e.modified, dropped_at.get(e.url, 0.0)) > grace_s]
    old_temps = [e for e in temps if now - e.modified > grace_s]
    if old_orphans and not referenced and not force:
        raise ManifestEmpty(
            f"{layout.root}: the manifest lists no shard, yet {len(objects)} shard objects are stored "
            f"({len(old_orphans)} past the grace period); deleting them would empty the data folder. "
            "Check that this is the right folder and that manifest/ is intact (`draftflow store ls`); "
            "if they really are all orphans, run gc again with --force. Nothing was deleted"
        )
    if not dry_run:
        for entry in old_orphans + old_temps:
            store.delete(entry.url)
        listed = {e.url for e in objects} - {e.url for e in old_orphans}
        for record in records:  # a record is done once none of its objects is left
            if not set(dropped_by[record.url]) & listed and now - record.modified > grace_s:
                store.delete(record.url)
    return GcReport(
        tuple(e.url for e in old_orphans), tuple(e.url for e in old_temps), len(orphans) - len(old_orphans)
    )


def store_clock(store: Store) -> float:
    """The store's idea of now: the modification time of a temp object written for the purpose."""
    url = paths.temp_sibling(paths.join(store.layout.shards_dir, "clock"), new_token())
    store.write_atomic(url, lambda f: f.write(b""))
    try:
        entry = next(
            e
            for e in store.list(store.layout.shards_dir, paths.TEMP_SUFFIX, include_temp=True)
            if e.url == url
        )
        return entry.modified
    finally:
        store.delete(url)
