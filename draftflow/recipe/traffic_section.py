"""The settings of a `traffic` source: served request/response logs read one window at a time.

A window is ``[since, until)``: ``until`` is the moment the run started (frozen in its run
reference, so a retried run reads the same lines), ``since`` comes from :attr:`TrafficSection.since`.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from pydantic import Field, field_validator

from draftflow.recipe.section import MAX_COUNT, Section

LAST_RUN = "last_run"
_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> timedelta | None:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"`` as a timedelta; None when not that form."""
    match = _DURATION.match(text.strip())
    if not match:
        return None
    return timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def parse_time(value: object) -> datetime | None:
    """A log timestamp or a recipe's instant as an aware UTC datetime: ISO 8601 text (naive = UTC) or
    Unix seconds (milliseconds when the number is too large to be seconds); None when unreadable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        seconds = value / 1000 if value > 1e11 else value
        try:
            return datetime.fromtimestamp(seconds, UTC)
        except (OverflowError, OSError, ValueError):
            return None
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            return None
        return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    return None


class TrafficSection(Section):
    """How a `traffic` source reads served request/response logs (OpenAI chat format, JSONL)."""

    paths: list[str] = Field(
        min_length=1,
        description="fsspec glob patterns of the log files (`logs/*.jsonl`, `s3://bucket/vllm/**/*.jsonl.gz`); "
        "`.gz` files are decompressed while read. Read with the store's storage options.",
    )
    since: str = Field(
        LAST_RUN,
        description="Start of the window (its end is the run's start): `last_run` (the end of the newest "
        "segment already listed in the store; everything on the first run), a duration back from the "
        "run's start (`7d`, `12h`, `30m`), or an ISO 8601 instant.",
    )
    timestamp_field: str = Field(
        "timestamp",
        description="Field of a log line holding its time (dotted for nested, e.g. `request.created`): "
        "ISO 8601 text or Unix seconds. A line without a readable time is counted and skipped.",
    )
    min_chars: int = Field(
        1, ge=1, le=MAX_COUNT, description="Skip conversations with fewer characters (all turns)."
    )
    max_chars: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Skip conversations with more characters (all turns)."
    )
    redact: bool = Field(
        True,
        description="Replace e-mail addresses, phone numbers, API keys and card numbers with "
        "placeholders before anything is stored.",
    )
    redact_with: str | None = Field(
        None,
        description="A function `package.module:function` taking a text and returning it redacted, run "
        "on every turn after the built-in patterns (also when `redact` is off).",
    )

    @field_validator("since")
    @classmethod
    def _since_form(cls, value: str) -> str:
        if value == LAST_RUN or parse_duration(value) is not None or parse_time(value) is not None:
            return value
        raise ValueError(
            f"`since` is `{LAST_RUN}`, a duration such as `7d` / `12h` / `30m`, or an ISO 8601 instant; "
            f"got {value!r}"
        )

    @field_validator("redact_with")
    @classmethod
    def _import_path_form(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            raise ValueError(f"`redact_with` is `package.module:function`, got {value!r}")
        return value
