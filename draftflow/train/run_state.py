"""One trainer per run folder, and no resume under other settings.

A run folder (recipe name + data fingerprint + run id) is resumed by rerunning the same
command. Two things could go silently wrong there:

* Two trainers on one run id (a retry while the first still runs, a second host) would both
  write `step-N`. Rank 0 holds a lock for the whole run: `flock` on a local (or NFS) folder,
  which the kernel drops when the process dies; on an object store, a lease object that rank 0
  renews every LEASE_S/3 seconds and that others treat as stale after LEASE_S (a killed
  trainer blocks its run id for at most that long). A renewal first checks that the lease
  still names this trainer (and on S3 writes only if the object is unchanged since that read);
  a failed one is retried with backoff. When the lease names someone else, or no renewal
  succeeded for 2/3 of LEASE_S, the training loop stops at the end of its step with
  :class:`LeaseLost` (non-zero exit): with a checkpoint while the lease still names this
  trainer and is fresh, writing nothing more otherwise.
* Rerunning with another lr, epochs, drafter… would continue the old optimizer state (or
  re-export finished weights under the new recipe). The settings that decide what a run
  computes are saved in `run.json`; a resume whose settings differ is refused with the fields
  that differ and the two ways to go on (`--run-id` for a separate run, `--force-new` to move
  the old run's files aside, never deleting them). Settings that change only how a run is
  operated (logging, checkpoint interval, device, run_dir, rendezvous, activation checkpointing)
  are not compared.
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

LEASE_S = 90.0  # renewed every third of it; read at run time, so tests may set a short one
GIVE_UP_FRACTION = 2 / 3  # no renewal for this part of LEASE_S: stop before others may take the run
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

# Drafter settings that trade memory for time, computing the same run: neither recorded nor compared
# (a run recorded with them still resumes with either value).
DRAFTER_NOT_COMPARED = frozenset({"activation_checkpointing"})


# Settings added after runs were first recorded, with the value that means "off": recorded only
# when set, so a run saved before they existed still resumes under the same recipe.
RECORDED_WHEN_SET = {"feature_noise": 0.0, "loss_positions": "assistant", "max_train_samples": None}


class TrainingRefused(RuntimeError):
    """The trainer will not start; the message says why and what to do."""


class RunLocked(TrainingRefused):
    """Another trainer holds the run folder."""


class LeaseLost(TrainingRefused):
    """The trainer lost its run folder's lease (another trainer took it, or it could not renew it)."""


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
        "drafter": {
            k: v for k, v in recipe.drafter.model_dump(mode="json").items() if k not in DRAFTER_NOT_COMPARED
        },
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
    if saved is not None:
        for key in DRAFTER_NOT_COMPARED & (saved.get("drafter") or {}).keys():
            del saved["drafter"][key]
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


class _Taken(Exception):
    """The lease object no longer names this trainer."""


class RunLock:
    """Exclusive use of a run folder by one trainer (see the module docstring)."""

    def __init__(self, layout: RunLayout):
        self.layout = layout
        self.fs, self.path = url_to_fs(layout.lock)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "token": secrets.token_hex(8)}
        self.problem: str | None = None  # set by the heartbeat once the lease is lost, for the loop
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = 0.0  # heartbeat time of the last lease write read back as ours
        self._conditional = "s3" in self.fs.protocol  # S3 PUT If-Match; other stores: read-back only

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
        if holder and not self._ours(holder) and time.time() - holder["heartbeat"] < LEASE_S:
            raise self._refused(_describe(holder))
        written = self._write_lease()
        time.sleep(1.0)  # two trainers that both saw no lease: the last writer wins, the other backs off
        holder = self._read_lease()
        if not self._ours(holder):
            raise self._refused(_describe(holder))
        self._renewed = written
        self._thread = threading.Thread(target=self._heartbeat, name="draftflow-run-lease", daemon=True)
        self._thread.start()

    def _ours(self, holder: dict | None) -> bool:
        return bool(holder) and holder.get("token") == self.owner["token"]

    def _read_lease(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return None

    def _write_lease(self, **conditions) -> float:
        now = time.time()
        self.fs.pipe_file(self.path, json.dumps({**self.owner, "heartbeat": now}).encode(), **conditions)
        return now

    def _heartbeat(self) -> None:
        retry = None  # seconds until the next try after a failed renewal, doubled each time
        while True:
            if retry is None:  # a third of the lease after the last renewal
                wait = self._renewed + LEASE_S / 3 - time.time()
            else:  # and the last retry at the deadline itself
                wait = min(retry, self._renewed + LEASE_S * GIVE_UP_FRACTION - time.time())
            if self._stop.wait(max(0.0, wait)):
                return
            try:
                self._renew()
                retry = None
            except _Taken as taken:
                self.problem = (
                    f"run folder {self.layout.root} was taken over by another trainer ({taken}) while this "
                    "one trained; this trainer stopped"
                )
                return
            except Exception as err:  # noqa: BLE001 - any store error is retried until the deadline
                late = time.time() - self._renewed
                if late >= LEASE_S * GIVE_UP_FRACTION:
                    self.problem = (
                        f"could not renew the lease {self.layout.lock} for {late:.0f} s (last error: {err}); "
                        f"after {LEASE_S:.0f} s another trainer may take the run folder, so this one stopped"
                    )
                    return
                retry = LEASE_S / 60 if retry is None else 2 * retry

    def _renew(self) -> None:
        """Rewrite the lease if it still names this trainer; _Taken if it names someone else."""
        try:
            tag = self.fs.info(self.path, refresh=True).get("ETag") if self._conditional else None
        except FileNotFoundError:
            raise _Taken(_describe(None)) from None
        holder = self._read_lease()
        if not self._ours(holder):
            raise _Taken(_describe(holder))
        if tag is None:
            written = self._write_lease()
        else:
            try:
                written = self._write_lease(IfMatch=tag)  # refused if anyone wrote since the read
            except OSError:
                if self.fs.info(self.path, refresh=True).get("ETag") != tag:
                    raise  # it changed: the next try reads who holds it now
                self._conditional = False  # unchanged, yet refused: a store without conditional PUT
                written = self._write_lease()
        if not self._ours(self._read_lease()):
            raise _Taken(_describe(self._read_lease()))
        self._renewed = written

    def may_write(self) -> bool:
        """Whether the lease still names this trainer and no other may take it yet (before a last
        checkpoint once renewal failed); False when the store cannot tell."""
        if self.local:
            return self._fd is not None
        try:
            holder = self._read_lease()
        except OSError:
            return False
        return self._ours(holder) and time.time() - holder["heartbeat"] < LEASE_S

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock; the file stays (removing it would race a new holder)
            self._fd = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            try:
                if self._ours(self._read_lease()):
                    self.fs.rm(self.path)
            except OSError as err:  # never hide why the trainer ends; the lease goes stale on its own
                print(
                    f"draftflow.train: could not remove the lease {self.layout.lock} ({err}); it expires "
                    f"after {LEASE_S:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )


def _describe(holder: dict | None) -> str:
    if not holder:
        return "the lease object is gone"
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}"


_held: RunLock | None = None  # the lease `claim` holds in this process (rank 0), for the loop's checks


def lease_problem() -> str | None:
    """Why this process's run folder lease was lost (rank 0; None elsewhere and while it holds)."""
    return _held.problem if _held is not None else None


def stop_for_lost_lease(runtime, save_checkpoint) -> LeaseLost:
    """Every rank, once a lost lease was agreed: rank 0 writes a last checkpoint if the lease still
    names it and is fresh (``save_checkpoint()`` returns its folder), nothing otherwise; the error to raise."""
    message = "rank 0 lost the run folder's lease (its error says why); stopped"
    if runtime.is_main:
        message = f"{_held.problem}. "
        if _held.may_write():
            try:
                message += (
                    f"The last step's checkpoint is {save_checkpoint()}: rerun the same command to resume"
                )
            except Exception as err:  # noqa: BLE001 - reported in the one error this stop raises
                message += f"No checkpoint could be written ({err}); a rerun resumes from the previous one"
        else:
            message += "Nothing more was written to the run folder; a rerun resumes from its last checkpoint"
    runtime.barrier()
    return LeaseLost(message)


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
    global _held
    lock = RunLock(layout)
    error = None
    if runtime.is_main:
        try:
            lock.acquire()
            _held = lock
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
            _held = None
            lock.release()


def check_settings_agreed(layout: RunLayout, runtime, settings: dict) -> None:
    error = None
    if runtime.is_main:
        try:
            check_settings(layout, settings)
        except Exception as err:  # noqa: BLE001 - re-raised by _agree on every rank
            error = err
    _agree(runtime, error, f"check the settings of run folder {layout.root}")
