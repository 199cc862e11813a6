"""Read served traffic: request/response logs in the OpenAI chat format, one JSON object a line.

A line is used when its time (``traffic.timestamp_field``) falls in the run's window. Its
conversation is the request's ``messages`` (top level, or under ``request``) followed by the
reply (``response.choices[0].message``, when logged); a line whose ``messages`` already end with
the assistant's turn needs no ``response``. Files are found by fsspec globs, streamed line by
line (``.gz`` decompressed on the fly), and read with the store's storage options.

Nothing in a log is fatal: a malformed line, a line without a time, outside the window, too
short or too long is counted under a reason and skipped; a file that cannot be read is counted,
logged by name, and the next file is read. Redaction runs before a conversation leaves this
module, so no other part of draftflow ever holds the text as logged.
"""

from __future__ import annotations

import io
import json
import logging
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from draftflow.data.redaction import Redactor, load_callable
from draftflow.data.segments import Window
from draftflow.data.sources import Conversation, normalise_conversation
from draftflow.recipe.load import expand
from draftflow.recipe.traffic_section import TrafficSection, parse_time
from draftflow.remote import url_to_fs

log = logging.getLogger(__name__)


def log_files(settings: TrafficSection, storage_options: dict | None = None) -> list[tuple[Any, str]]:
    """(filesystem, path) of every file the globs match, each once, sorted by path."""
    found: dict[str, tuple[Any, str]] = {}
    for pattern in settings.paths:
        fs, path = url_to_fs(expand(pattern), storage_options)
        fs.invalidate_cache()  # a log written since this process last listed the folder must show
        matches = fs.glob(path) if any(c in path for c in "*?[") else ([path] if fs.exists(path) else [])
        for match in matches:
            if fs.isfile(match):
                found.setdefault(f"{fs.protocol}:{match}", (fs, match))
    return [found[key] for key in sorted(found)]


def _field(record: dict, dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def turns_of(record: Any) -> Any:
    """The turns of one logged exchange: the request's messages, then the logged reply if any."""
    if not isinstance(record, dict):
        return None
    request = record.get("request") if isinstance(record.get("request"), dict) else record
    messages = request.get("messages")
    if not isinstance(messages, list):
        return None
    response = record.get("response")
    if isinstance(response, dict):
        choices = response.get("choices")
        reply = (
            choices[0].get("message")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict)
            else None
        )
        if isinstance(reply, dict):
            return [*messages, {"role": reply.get("role") or "assistant", "content": reply.get("content")}]
    return messages


def _modified(fs: Any, path: str) -> datetime | None:
    try:
        return parse_time(fs.modified(path).isoformat())
    except Exception:  # not every backend reports it; the file is then read
        return None


def read_traffic(
    settings: TrafficSection,
    window: Window,
    dropped: Counter,
    counts: Counter,
    storage_options: dict | None = None,
) -> Iterator[Conversation]:
    """Every usable conversation logged in ``window``, redacted; skips counted in ``dropped``,
    what was read (``lines``, ``files``, ``unreadable_files``, ``redacted:KIND``,
    ``redacted_conversations``) in ``counts``."""
    redactor = Redactor(
        builtin=settings.redact,
        custom=load_callable(settings.redact_with) if settings.redact_with else None,
    )
    for fs, path in log_files(settings, storage_options):
        modified = _modified(fs, path)
        if window.since is not None and modified is not None and modified < window.since:
            counts["files_before_window"] += 1  # last written before the window began
            continue
        counts["files"] += 1
        try:
            yield from _read_file(fs, path, settings, window, redactor, dropped, counts)
        except (OSError, EOFError, UnicodeError, ValueError) as err:  # gzip/CRC errors, a vanished object
            counts["unreadable_files"] += 1
            log.warning(
                "traffic log %s could not be read to its end (%s: %s): skipped the rest",
                path,
                type(err).__name__,
                err,
            )


def _read_file(
    fs: Any,
    path: str,
    settings: TrafficSection,
    window: Window,
    redactor: Redactor,
    dropped: Counter,
    counts: Counter,
) -> Iterator[Conversation]:
    with fs.open(path, "rb", compression="infer") as raw:
        for line in io.TextIOWrapper(raw, encoding="utf-8", errors="replace"):
            if not line.strip():
                continue
            counts["lines"] += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped["malformed_json"] += 1
                continue
            if not isinstance(record, dict):
                dropped["malformed_record"] += 1
                continue
            when = parse_time(_field(record, settings.timestamp_field))
            if when is None:
                dropped["no_timestamp"] += 1
                continue
            if when not in window:
                dropped["outside_window"] += 1
                continue
            conversation, reason = normalise_conversation(turns_of(record))
            if conversation is None:
                dropped[reason] += 1
                continue
            size = sum(len(m["content"]) for m in conversation)
            if size < settings.min_chars:
                dropped["too_short"] += 1
                continue
            if settings.max_chars is not None and size > settings.max_chars:
                dropped["too_long"] += 1
                continue
            try:
                conversation, found = redactor.conversation(conversation)
            except Exception as err:  # a user's redaction callable: the line is dropped, never kept raw
                dropped["redaction_failed"] += 1
                if dropped["redaction_failed"] == 1:  # its message may quote the text: not logged
                    log.warning(
                        "redaction raised %s on a line of %s: line dropped (counted as redaction_failed)",
                        type(err).__name__,
                        path,
                    )
                continue
            if found:
                counts["redacted_conversations"] += 1
                counts.update({f"redacted:{kind}": n for kind, n in found.items()})
            yield conversation
