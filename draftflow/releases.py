"""Releases at a publish destination: which version is in service, what happened, and a way back.

Publishing writes each version to ``DEST/NAME-VERSION/`` (:func:`draftflow.publish.push_fsspec`),
complete once its ``PUBLISHED`` marker exists. Beside the version folders, each recipe NAME has

- ``DEST/NAME.current.json``, the **pointer**: the version folder in service, its version, when
  and by which event it was set, and the version it replaced;
- ``DEST/NAME.history.jsonl``, the **history**: one JSON object per line and event (``published``,
  ``promoted``, ``rolled back``, ``refused``) with its time, version, previous version and a free
  ``details`` object (τ, speed-up, a decision's inputs).

Nothing here deletes a version. Atomicity: a version is complete (marker written) before the
pointer may name it (:meth:`Releases.promote` and :meth:`Releases.rollback` check the marker
first), and the pointer and the history are each replaced whole: on a local folder by a temporary
file, fsync and ``os.replace``; on an object store by one PUT of one small object, which readers
see whole or not at all. A kill between the pointer and the history line leaves the pointer
right and the history one line short; the pointer holds what that line says, and the next change
of the pointer writes the line first. :meth:`Releases.current` checks the marker again, so a
reader never gets a version without one. One writer per destination and recipe at a time: two
writers at once may lose a history line (read and rewritten whole) or the pointer's last word.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from draftflow import __version__
from draftflow.paths import PUBLISHED_MARKER, join
from draftflow.paths import RELEASE_HISTORY_SUFFIX as HISTORY_SUFFIX
from draftflow.paths import RELEASE_POINTER_SUFFIX as POINTER_SUFFIX
from draftflow.remote import url_to_fs

log = logging.getLogger(__name__)

MOVES = ("published", "promoted", "rolled back")  # the events that set the pointer
EVENTS = (*MOVES, "refused")
_RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # as the recipe schema's `name`
_VERSION = re.compile(r"[0-9a-f]{16}")


class ReleaseError(RuntimeError):
    """A pointer, version or rollback that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class Release:
    """What the pointer says: the version in service and how it got there."""

    recipe: str
    folder: str  # NAME-VERSION
    version: str
    url: str  # the version folder (a local path for a local destination)
    set_at: str  # ISO 8601, UTC
    event: str
    previous: str | None  # the version it replaced
    details: dict | None = None  # as in the event's history line


@dataclass(frozen=True)
class Version:
    folder: str
    version: str
    url: str
    published_at: str  # the marker's time (ISO 8601, UTC)
    current: bool


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def marker_bytes(version: str) -> bytes:
    """The ``PUBLISHED`` marker's content: the version and when it was completed."""
    return json.dumps({"version": version, "published_at": now()}).encode()


class Releases:
    """One recipe's releases at one destination: an fsspec folder URL (local or object store).

    ``storage_options``: fsspec options of a remote destination (None: ``$DRAFTFLOW_STORAGE_OPTIONS``).
    """

    def __init__(self, dest: str, recipe: str, storage_options: dict | None = None):
        if dest.startswith("hf://"):
            raise ReleaseError(
                f"{dest}: a Hub repository keeps no release pointer (the Hub has its own revisions); "
                "releases are for fsspec destinations"
            )
        if not _RECIPE_NAME.fullmatch(recipe or ""):
            raise ReleaseError(f"recipe {recipe!r}: not a recipe name (letters, digits, '.', '_', '-')")
        self.dest, self.recipe = dest.rstrip("/"), recipe
        self.fs, root = url_to_fs(self.dest, storage_options)
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.pointer_path = f"{self.root}/{recipe}{POINTER_SUFFIX}"
        self.history_path = f"{self.root}/{recipe}{HISTORY_SUFFIX}"

    # reading

    def url(self, folder: str) -> str:
        url = join(self.dest, folder)
        return url.removeprefix("file://") if self.local else url

    def folder_of(self, version: str) -> str:
        """``VERSION``, ``NAME-VERSION`` or a version folder's URL → ``NAME-VERSION``."""
        base = version.rstrip("/").rsplit("/", 1)[-1]
        if _VERSION.fullmatch(base):
            return f"{self.recipe}-{base}"
        if base.startswith(self.recipe + "-") and _VERSION.fullmatch(base[len(self.recipe) + 1 :]):
            return base
        raise ReleaseError(
            f"{version!r} is not a version of {self.recipe}: give the 16-hex VERSION or the folder "
            f"name {self.recipe}-VERSION (`draftflow releases list` shows them)"
        )

    def marker(self, folder: str) -> dict | None:
        """The version's ``PUBLISHED`` marker, None when it has none (incomplete or absent)."""
        raw = self._read(f"{self.root}/{folder}/{PUBLISHED_MARKER}")
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            data = {}
        return data if isinstance(data, dict) else {}

    def pointer(self) -> Release | None:
        """The pointer as written (not checked against the version's marker); None when absent."""
        raw = self._read(self.pointer_path)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            folder = self.folder_of(data["folder"])
            return Release(
                self.recipe,
                folder,
                folder.rsplit("-", 1)[1],
                self.url(folder),
                str(data.get("set_at", "")),
                str(data.get("event", "")),
                data.get("previous"),
                data.get("details") if isinstance(data.get("details"), dict) else None,
            )
        except (ValueError, KeyError, TypeError, AttributeError, ReleaseError) as err:
            raise ReleaseError(
                f"{self.url(self.recipe + POINTER_SUFFIX)}: not a release pointer ({err}); "
                f"`draftflow releases rollback --to VERSION` writes a new one"
            ) from None

    def current(self) -> Release:
        """The version in service, checked complete: raises :class:`ReleaseError` otherwise."""
        self.fs.invalidate_cache()
        release = self.pointer()
        if release is None:
            raise ReleaseError(
                f"{self.dest}: no current release of {self.recipe} (no {self.recipe}{POINTER_SUFFIX}): "
                "publish a version there first"
            )
        self._check_complete(release.folder, "the current pointer names")
        return release

    def history(self) -> list[dict]:
        """The history's events, oldest first (a line that is not a JSON object is skipped)."""
        events = []
        for n, line in enumerate((self._read(self.history_path) or b"").decode().splitlines(), 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict):
                events.append(event)
            else:
                log.warning("%s line %d: not a JSON object; skipped", self.history_path, n)
        return events

    def versions(self) -> list[Version]:
        """The complete (marked) versions, newest first, the current one flagged."""
        self.fs.invalidate_cache()
        try:
            pointer = self.pointer()
        except ReleaseError as err:  # still list: the listing is how to choose a --to
            log.warning("%s", err)
            pointer = None
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            entries = []
        found = []
        for entry in entries:
            folder = entry.rstrip("/").rsplit("/", 1)[-1]
            if not folder.startswith(self.recipe + "-") or not _VERSION.fullmatch(
                folder[len(self.recipe) + 1 :]
            ):
                continue  # another recipe's, a pointer, a hidden partial copy
            marker = self.marker(folder)
            if marker is None:
                continue
            when = marker.get("published_at") or self._modified(f"{self.root}/{folder}/{PUBLISHED_MARKER}")
            current = pointer is not None and pointer.folder == folder
            found.append(Version(folder, folder.rsplit("-", 1)[1], self.url(folder), when, current))
        return sorted(found, key=lambda v: v.published_at, reverse=True)

    # writing

    def promote(self, version: str, *, event: str = "published", details: dict | None = None) -> Release:
        """Point ``current`` at ``version`` (complete) and append the event; when it is current
        already, return the pointer as it is (writing only a history line a kill prevented)."""
        if event not in ("published", "promoted"):
            raise ValueError(f"promote: event {event!r} is not 'published' or 'promoted'")
        self.fs.invalidate_cache()
        folder = self.folder_of(version)
        self._check_complete(folder, "cannot point at")
        try:
            before = self.pointer()
        except ReleaseError as err:  # a damaged pointer is replaced by this one
            log.warning("%s", err)
            before = None
        if before is not None and before.folder == folder:
            self._recover(before)
            return before
        return self._move(folder, event, before, details)

    def rollback(self, to: str | None = None, *, details: dict | None = None) -> Release:
        """Point ``current`` back: at ``to`` (a complete version), else at the release before the
        current one, skipping releases already rolled back from. Appends the event; deletes nothing."""
        self.fs.invalidate_cache()
        try:
            before = self.pointer()
        except ReleaseError:
            if to is None:
                raise
            before = None  # a damaged pointer: --to replaces it
        if to is not None:
            folder = self.folder_of(to)
        elif before is None:
            raise ReleaseError(
                f"{self.dest}: no current release of {self.recipe}: nothing to roll back from "
                "(give --to VERSION to set one)"
            )
        else:
            stack = self._stack(before.version)
            if len(stack) < 2:
                raise ReleaseError(
                    f"{self.dest}: no earlier release of {self.recipe} in its history than the current "
                    f"{before.version}: give --to VERSION (`draftflow releases list` shows them)"
                )
            folder = f"{self.recipe}-{stack[-2]}"
        self._check_complete(folder, "cannot roll back to")
        if before is not None and before.folder == folder:
            self._recover(before)
            return before
        return self._move(folder, "rolled back", before, {"requested": to, **(details or {})})

    def record(self, event: str, version: str | None, details: dict | None = None) -> None:
        """Append an event that does not move the pointer (``refused``: a version not promoted)."""
        if event != "refused":
            raise ValueError(f"record: event {event!r} moves the pointer; use promote or rollback")
        pointer = self.pointer()
        self._append(
            {
                "time": now(),
                "event": event,
                "version": self.folder_of(version).rsplit("-", 1)[1] if version else None,
                "previous": pointer.version if pointer else None,
                "details": details or {},
            }
        )

    def _stack(self, current: str) -> list[str]:
        """The releases the pointer went through, rolled-back ones popped, ``current`` on top."""
        stack: list[str] = []
        for event in self.history():
            kind, version = event.get("event"), event.get("version")
            if kind not in MOVES or not isinstance(version, str):
                continue
            if kind == "rolled back" and version in stack:
                del stack[len(stack) - stack[::-1].index(version) :]
            elif not stack or stack[-1] != version:
                stack.append(version)
        if not stack or stack[-1] != current:  # a pointer whose history line a kill prevented
            stack.append(current)
        return stack

    def _move(self, folder: str, event: str, before: Release | None, details: dict | None) -> Release:
        if before is not None:
            self._recover(before)
        when, version = now(), folder.rsplit("-", 1)[1]
        previous = before.version if before else None
        line = {
            "time": when,
            "event": event,
            "version": version,
            "previous": previous,
            "details": details or {},
        }
        pointer = {
            "recipe": self.recipe,
            "folder": folder,
            "version": version,
            "set_at": when,
            "event": event,
            "previous": previous,
            "details": details or {},
            "draftflow": __version__,
        }
        if self.local:  # the version folder's rename is on disk before a pointer names it
            _fsync(Path(self.root))
        self._write(self.pointer_path, (json.dumps(pointer, indent=2) + "\n").encode())
        self._append(line)
        return Release(self.recipe, folder, version, self.url(folder), when, event, previous, details or {})

    def _recover(self, before: Release) -> None:
        """Write the pointer's own history line when a kill came between the two writes (the pointer
        holds all the line says): the history is never more than the current pointer's line behind."""
        moves = [e for e in self.history() if e.get("event") in MOVES]
        if moves and (moves[-1].get("version"), moves[-1].get("time")) == (before.version, before.set_at):
            return
        log.warning("%s: writing the missing history line of %s", self.dest, before.folder)
        details = {**(before.details or {}), "recovered": "from the pointer"}
        self._append(
            {
                "time": before.set_at,
                "event": before.event,
                "version": before.version,
                "previous": before.previous,
                "details": details,
            }
        )

    def _append(self, event: dict) -> None:
        raw = self._read(self.history_path) or b""
        if raw and not raw.endswith(b"\n"):
            raw += b"\n"
        self._write(self.history_path, raw + (json.dumps(event, ensure_ascii=False) + "\n").encode())

    def _check_complete(self, folder: str, what: str) -> None:
        marker = self.marker(folder)
        if marker is None:
            there = self.fs.exists(f"{self.root}/{folder}")
            raise ReleaseError(
                f"{self.dest}: {what} {folder}, "
                + (
                    f"which has no {PUBLISHED_MARKER} marker: an incomplete push, not a version "
                    "(publish it again to complete it)"
                    if there
                    else "which does not exist there"
                )
                + "; `draftflow releases list` shows the complete versions"
            )
        if marker.get("version", folder.rsplit("-", 1)[1]) != folder.rsplit("-", 1)[1]:
            raise ReleaseError(f"{self.dest}: {folder}'s {PUBLISHED_MARKER} marker names another version")

    def _read(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def _write(self, path: str, data: bytes) -> None:
        """Replace ``path`` whole: readers see the old content or the new, never a part."""
        if not self.local:
            self.fs.pipe_file(path, data)  # one PUT of one small object
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(f".{glob.escape(target.name)}.tmp-*"):  # left by a kill
            stale.unlink(missing_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(6)}")
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync(target.parent)

    def _modified(self, path: str) -> str:
        when = self.fs.modified(path)
        return (
            (when if when.tzinfo else when.replace(tzinfo=UTC))
            .astimezone(UTC)
            .isoformat(timespec="microseconds")
        )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current(dest: str, recipe: str, storage_options: dict | None = None) -> Release:
    return Releases(dest, recipe, storage_options).current()


def list_versions(dest: str, recipe: str, storage_options: dict | None = None) -> list[Version]:
    return Releases(dest, recipe, storage_options).versions()


def history(dest: str, recipe: str, storage_options: dict | None = None) -> list[dict]:
    return Releases(dest, recipe, storage_options).history()


def rollback(dest: str, recipe: str, to: str | None = None, storage_options: dict | None = None) -> Release:
    return Releases(dest, recipe, storage_options).rollback(to)
