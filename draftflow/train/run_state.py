"""One trainer per run folder, and no resume under other settings.

A run folder (recipe name + data fingerprint + run id) is resumed by rerunning the same
command. Two things could go silently wrong there:

* Two trainers on one run id (a retry while the first still runs, a second host) would both
  write `step-N`. Rank 0 holds a lock for the whole run: `flock` on a local (or NFS) folder,
  which the kernel drops when the process dies; on an object store, a lease object that rank 0
  rewrites every LEASE_S/3 seconds and that others treat as stale after LEASE_S (a killed
  trainer blocks its run id for at most that long).
* Rerunning with another lr, epochs, drafter… would continue the old optimizer state (or
  re-export finished weights under the new recipe). The settings that decide what a run
  computes are saved in `run.json`; a resume whose settings differ is refused with the fields
  that differ and the two ways to go on (`--run-id` for a separate run, `--force-new` to move
  the old run's files aside, never deleting them). Settings that change only how a run is
  operated (logging, checkpoint interval, device, run_dir, rendezvous) are not compared.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator

from fsspec.implementations.local import LocalFileSystem

from draftflow.paths import RunLayout, join
from draftflow.remote import url_to_fs
from draftflow.train import checkpointing

LEASE_S = 90.0
NOT_COMPARED = frozenset(
    {
        "log_every",
        "checkpoint_every",
        "run_dir",
        "run_dir_shared",
        "rdzv_endpoint",
        "device",
        "nproc",
        "nnodes",
        "max_missing_fraction",
    }
)


# Settings added after runs were first recorded, with the value that means "off": recorded only
# when set, so a run saved before they existed still resumes under the same recipe.
RECORDED_WHEN_SET = {"feature_noise": 0.0, "loss_positions": "assistant", "max_train_samples": None}


class TrainingRefused(RuntimeError):
    """The trainer will not start; the message says why and what to do."""


class RunLocked(TrainingRefused):
    """Another trainer holds the run folder."""


class RunSettingsChanged(TrainingRefused):
    """The run folder holds state trained under other settings."""


def run_settings(recipe, world_size: int, skipped: list[str]) -> dict:
    """What decides the run's result: the optimisation, the drafter, the global batch, the data left out."""
    training = {
        k: v
        for k, v in recipe.training.model_dump(mode="json").items()
        if k not in NOT_COMPARED and RECORDED_WHEN_SET.get(k, object()) != v
    }
    ids = "\n".join(sorted(skipped)).encode()
    return {
        "training": training,
        "drafter": recipe.drafter.model_dump(mode="json"),
        "processes": world_size,
        "skipped_samples": {"count": len(skipped), "sha256": hashlib.sha256(ids).hexdigest()},
    }


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def differences(saved: dict, current: dict) -> list[str]:
    a, b = _flatten(saved), _flatten(current)
    return [
        f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k, "(unset)") != b.get(k, "(unset)")
    ]


def has_state(layout: RunLayout) -> bool:
    """A checkpoint with its marker, or an export: something a rerun would continue from."""
    fs, export = url_to_fs(layout.export_dir)
    return bool(checkpointing.marked_steps(layout)) or fs.exists(export)


def check_settings(layout: RunLayout, settings: dict) -> None:
    """Refuse to resume a run saved under other settings; record the settings of a fresh one."""
    fs, path = url_to_fs(layout.settings)
    saved = json.loads(fs.cat_file(path)) if fs.exists(path) else None
    if saved == settings:
        return
    if saved is not None and has_state(layout):
        raise RunSettingsChanged(
            f"run folder {layout.root} holds a run trained with other settings "
            f"({'; '.join(differences(saved, settings))}); resuming would continue it (or re-export its "
            "weights) under the new ones. Start a separate run with --run-id NEW_ID, or pass --force-new to "
            "move this run's files aside (to RUN_ID.replaced-TIME) and start again"
        )
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    checkpointing.put_whole(layout.settings, json.dumps(settings, indent=1, sort_keys=True).encode())


def set_aside(layout: RunLayout) -> str | None:
    """--force-new: move the run's files (not its lock) beside it; returns where, None if nothing was there."""
    fs, root = url_to_fs(layout.root)
    lock = url_to_fs(layout.lock)[1]
    entries = [e for e in fs.ls(root, detail=False) if e.rstrip("/") != lock] if fs.exists(root) else []
    if not entries:
        return None
    target = layout.set_aside(time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    fs_t, target_path = url_to_fs(target)
    fs_t.makedirs(target_path, exist_ok=True)
    for entry in entries:
        fs.mv(entry, join(target_path, entry.rstrip("/").rsplit("/", 1)[-1]), recursive=True)
    return target


class RunLock:
    """Exclusive use of a run folder by one trainer (see the module docstring)."""

    def __init__(self, layout: RunLayout):
        self.layout = layout
        self.fs, self.path = url_to_fs(layout.lock)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "token": secrets.token_hex(8)}
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _refused(self, holder: str) -> RunLocked:
        return RunLocked(
            f"run folder {self.layout.root} is in use by another trainer ({holder}); wait for it "
            "to finish, or train under another --run-id"
        )

    def acquire(self) -> None:
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        if self.local:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown holder"
                os.close(fd)
                raise self._refused(holder) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({**self.owner, "since": time.time()}).encode(), 0)
            self._fd = fd
            return
        holder = self._read_lease()
        if (
            holder
            and holder.get("token") != self.owner["token"]
            and time.time() - holder["heartbeat"] < LEASE_S
        ):
            raise self._refused(f"host {holder.get('host')} pid {holder.get('pid')}")
        self._write_lease()
        time.sleep(1.0)  # two trainers that both saw no lease: the last writer wins, the other backs off
        holder = self._read_lease()
        if not holder or holder.get("token") != self.owner["token"]:
            raise self._refused(f"host {holder.get('host') if holder else '?'}")
        self._thread = threading.Thread(target=self._heartbeat, name="draftflow-run-lease", daemon=True)
        self._thread.start()

    def _read_lease(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return None

    def _write_lease(self) -> None:
        self.fs.pipe_file(self.path, json.dumps({**self.owner, "heartbeat": time.time()}).encode())

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_S / 3):
            self._write_lease()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock; the file stays (removing it would race a new holder)
            self._fd = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            holder = self._read_lease()
            if holder and holder.get("token") == self.owner["token"]:
                self.fs.rm(self.path)


def record_skipped(layout: RunLayout, runtime, skipped: dict[str, str]) -> None:
    """Rank 0 writes the samples this run trains without, with each one's reason, and says how many."""
    if not runtime.is_main or not skipped:
        return
    url_to_fs(layout.root)[0].makedirs(url_to_fs(layout.root)[1], exist_ok=True)
    checkpointing.put_whole(layout.skipped_samples, json.dumps(skipped, indent=1, sort_keys=True).encode())
    print(
        f"draftflow.train: training without {len(skipped)} train samples that are not available "
        f"(training.max_missing_fraction); listed with reasons in {layout.skipped_samples}",
        file=sys.stderr,
        flush=True,
    )


def _agree(runtime, error: Exception | None, what: str) -> None:
    """Raise on every rank when rank 0 (or any rank) failed, so no rank waits in a collective."""
    failing = runtime.ranks_with(error is not None)
    if error is not None:
        raise error
    if failing:
        raise TrainingRefused(f"rank(s) {failing} failed to {what}; see their error")


@contextlib.contextmanager
def claim(layout: RunLayout, runtime, force_new: bool = False) -> Iterator[None]:
    """Rank 0 holds the run folder's lock for the duration; with `force_new`, old files are moved aside."""
    lock = RunLock(layout)
    error = None
    if runtime.is_main:
        try:
            lock.acquire()
            if force_new and (moved := set_aside(layout)):
                print(
                    f"draftflow.train: --force-new: the earlier run's files are now in {moved}",
                    file=sys.stderr,
                    flush=True,
                )
        except Exception as err:  # noqa: BLE001 - re-raised below, after every rank knows
            error = err
    _agree(runtime, error, f"claim run folder {layout.root}")
    try:
        yield
    finally:
        if runtime.is_main:
            lock.release()


def check_settings_agreed(layout: RunLayout, runtime, settings: dict) -> None:
    error = None
    if runtime.is_main:
        try:
            check_settings(layout, settings)
        except Exception as err:  # noqa: BLE001 - re-raised by _agree on every rank
            error = err
    _agree(runtime, error, f"check the settings of run folder {layout.root}")
