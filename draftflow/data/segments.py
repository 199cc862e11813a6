"""A recipe with a traffic source builds its data one window at a time: one segment per window.

A segment is an ordinary data folder (``STORE/NAME-FINGERPRINT/``), its fingerprint hashing the
window with everything else. ``STORE/NAME.segments.jsonl`` (:func:`draftflow.paths.segment_index`)
lists the segments whose preparation and extraction completed, oldest first; a segment is listed
once, after its last shard committed, and never rewritten. A crash leaves an unlisted folder that a
retry of the same run (same window, same fingerprint) completes.

``since: last_run`` starts a window where the newest listed segment's ended, and a new segment drops
every conversation an earlier listed segment kept (sample ids hash the conversation's content).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow.parquet as pq

from draftflow.data.dataset import atomic_write, read_report
from draftflow.paths import DataLayout, segment_index
from draftflow.recipe.traffic_section import LAST_RUN, TrafficSection, parse_duration, parse_time
from draftflow.remote import options_for, url_to_fs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Window:
    """``[since, until)`` in UTC; ``since`` None: from the beginning of the logs."""

    since: datetime | None
    until: datetime

    def __contains__(self, when: datetime) -> bool:
        return (self.since is None or when >= self.since) and when < self.until

    def as_dict(self) -> dict[str, str | None]:
        return {"since": _iso(self.since) if self.since else None, "until": _iso(self.until)}

    @classmethod
    def from_dict(cls, value: dict) -> Window:
        since = parse_time(value["since"]) if value.get("since") else None
        until = parse_time(value["until"])
        if until is None:
            raise ValueError(f"not a window: {value!r}")
        return cls(since, until)

    def __str__(self) -> str:
        return f"[{_iso(self.since) if self.since else 'the first line'}, {_iso(self.until)})"


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat(timespec="seconds")


def run_start() -> datetime:
    """``until`` of a new run's window: now, to the second (it is written into names and logs)."""
    return datetime.now(UTC).replace(microsecond=0)


def resolve_window(settings: TrafficSection, store: str, name: str, storage_options: dict | None) -> Window:
    """The window a run starting now reads: until now, since what ``settings.since`` says."""
    until = run_start()
    if settings.since == LAST_RUN:
        return Window(last_until(store, name, storage_options), until)
    back = parse_duration(settings.since)
    since = until - back if back is not None else parse_time(settings.since)
    if since is not None and since >= until:
        raise ValueError(
            f"data.sources: traffic window starts ({_iso(since)}) at or after the run ({_iso(until)})"
        )
    return Window(since, until)


def list_segments(store: str, name: str, storage_options: dict | None = None) -> list[dict]:
    """The listed segments, oldest first (empty when none is listed yet)."""
    url = segment_index(store, name)
    fs, path = url_to_fs(url, storage_options)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return []
    with fs.open(path, "rb") as f:
        lines = f.read().decode("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def last_until(store: str, name: str, storage_options: dict | None = None) -> datetime | None:
    """Where the newest listed segment's window ended (None: nothing listed yet)."""
    ends = [parse_time(s["window"]["until"]) for s in list_segments(store, name, storage_options)]
    return max((e for e in ends if e is not None), default=None)


def earlier_sample_ids(
    store: str, name: str, fingerprint: str, storage_options: dict | None = None
) -> set[str]:
    """Sample ids kept by every listed segment other than ``fingerprint``."""
    ids: set[str] = set()
    for segment in list_segments(store, name, storage_options):
        if segment["fingerprint"] == fingerprint:
            continue
        layout = DataLayout.for_recipe(store, name, segment["fingerprint"])
        fs, path = url_to_fs(layout.samples, options_for(store, storage_options))
        ids.update(pq.read_table(path, filesystem=fs, columns=["sample_id"])["sample_id"].to_pylist())
    return ids


def list_segment(
    store: str, name: str, fingerprint: str, window: Window, storage_options: dict | None = None
) -> dict:
    """Append the segment ``fingerprint`` to the index (once; a listed one is returned as it is).

    Called after its last shard committed. The whole index is rewritten through a temporary
    object and a move, so a reader sees it with or without the new line, never a part."""
    listed = list_segments(store, name, storage_options)
    for segment in listed:
        if segment["fingerprint"] == fingerprint:
            return segment
    layout = DataLayout.for_recipe(store, name, fingerprint)
    report = read_report(layout, options_for(store, storage_options))
    entry = {
        "fingerprint": fingerprint,
        "folder": layout.root.rstrip("/").rsplit("/", 1)[-1],
        "window": window.as_dict(),
        "counts": segment_counts(report),
        "listed_at": _iso(datetime.now(UTC)),
    }
    text = "".join(json.dumps(s, sort_keys=True) + "\n" for s in [*listed, entry])
    atomic_write(
        segment_index(store, name), options_for(store, storage_options), lambda f: f.write(text.encode())
    )
    log.info("segment %s listed: window %s, counts %s", entry["folder"], window, entry["counts"])
    return entry


def segment_counts(report: dict) -> dict[str, int]:
    """What a segment's preparation read and kept (the release history and the docs name these)."""
    out = {
        "lines": 0,
        "malformed": 0,
        "outside_window": 0,
        "redacted": 0,
        "redaction_failed": 0,
        "duplicates": 0,
    }
    for stats in report.get("sources", {}).values():
        traffic = stats.get("traffic", {})
        dropped = stats.get("dropped", {})
        out["lines"] += traffic.get("lines", 0)
        out["redacted"] += traffic.get("redacted_conversations", 0)
        out["redaction_failed"] += dropped.get("redaction_failed", 0)
        out["malformed"] += sum(v for k, v in dropped.items() if k.startswith("malformed"))
        out["outside_window"] += dropped.get("outside_window", 0)
        out["duplicates"] += dropped.get("duplicate", 0) + dropped.get("seen_in_earlier_segment", 0)
    kept = report.get("kept", {})
    out["kept"] = int(sum(kept.values()))
    return out
