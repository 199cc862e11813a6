"""The hidden-states file vLLM writes per request: lock, read, validate, delete.

Protocol (vLLM 0.22+): the response names the file *before* the write finishes; the server
holds an exclusive ``flock`` on ``<path>.lock`` until it is complete, so a reader takes the
lock (shared or exclusive) first. vLLM never deletes either file: the reader must, whatever
happens, or the staging dir (often /dev/shm, i.e. RAM) fills up. Files are read with
safetensors only (never pickle), and anything that does not match the prompt exactly is
a corrupt sample, never training data: it raises :class:`InvalidHiddenStates` with the reason.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import time
from collections.abc import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes

from draftflow.vllm.errors import InvalidHiddenStates

# vLLM's hidden-states connector names each file after the engine's request id:
# ``<shared_storage_path>/<req_id>.safetensors`` (+ ``.lock``). For the OpenAI completion endpoints
# draftflow calls, that id is ``cmpl-<X-Request-Id>-<prompt index>-<suffix>`` (``chatcmpl-`` for
# chat): nothing else in a staging folder was written for draftflow's requests.
STAGING_NAME = re.compile(r"(?:chat)?cmpl-[A-Za-z0-9][A-Za-z0-9._~-]*\.safetensors(?:\.lock)?")


# safetensors writes a file through a temporary sibling (Rust's tempfile crate: `.tmp` + 6 characters)
# renamed over the name once complete; a server killed mid-write leaves that sibling behind.
WRITER_TEMP_NAME = re.compile(r"\.tmp[A-Za-z0-9]{6}")
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


def is_writer_temp(folder: str, name: str) -> bool:
    """Whether ``name`` in ``folder`` is an interrupted safetensors write: the temporary name, a
    regular file, and empty, or sized but not yet written (safetensors sets the final length before
    it writes: zeros), or beginning as a safetensors file does (an 8-byte header length, then the
    JSON header's ``{``)."""
    if not WRITER_TEMP_NAME.fullmatch(name):
        return False
    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone, or a symlink: not a write of ours
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, 9)
    finally:
        os.close(fd)
    if not head or head == bytes(9):  # a sized temp file is at least a header length and `{}` long
        return True
    return len(head) == 9 and 2 <= int.from_bytes(head[:8], "little") <= _MAX_HEADER and head[8:] == b"{"


class ForeignStagingFolder(ValueError):
    """A staging folder holds files the hidden-states connector did not write; nothing was deleted."""


def is_staging_name(name: str) -> bool:
    """Whether `name` is a hidden-states file (or its lock) as the connector names it."""
    return STAGING_NAME.fullmatch(name) is not None


def wait_for_lock(lock_path: str, timeout_s: float, exclusive: bool = False) -> int:
    """Open `lock_path` and flock it; returns the fd (closing it releases the lock).

    Polls with LOCK_NB rather than blocking so a writer that never finishes cannot hang us.
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        raise InvalidHiddenStates(
            "lock file missing: the server's staging dir is not visible here (client and server "
            "must share it) or the server runs without use_synchronization_lock",
            lock_path,
        ) from None
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        try:
            fcntl.flock(fd, mode)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise InvalidHiddenStates(
                    f"writer still holds the lock after {timeout_s:.0f}s", lock_path
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def staging_path(path: str, staging_dirs: Sequence[str]) -> str:
    """`path` when a server named a file inside one of our staging folders; else InvalidHiddenStates.

    The path comes from a server's HTTP answer, and this process deletes what it reads: an
    endpoint answering ``~/.ssh/id_ed25519`` or a model's weights must not get them deleted
    (or read). Accepted: an absolute path without ``..``, named as the connector names its
    files (:data:`STAGING_NAME`), whose folder resolves inside a configured staging folder,
    and which (with its ``.lock``) is not a symlink. Nothing is touched when the path is refused.
    """
    if not staging_dirs:
        raise InvalidHiddenStates(
            "no staging folder is configured, so no server-named file is read or deleted "
            "(set vllm.staging_dirs or vllm.launch.staging_dir)",
            path,
        )
    if not isinstance(path, str) or not os.path.isabs(path) or "\x00" in path:
        raise InvalidHiddenStates(
            "server named a hidden-states path that is not absolute; left untouched", str(path)
        )
    if ".." in path.split(os.sep) or not path.endswith(".safetensors"):
        raise InvalidHiddenStates(
            "server named a path with '..' or not ending in .safetensors; left untouched", path
        )
    folder = os.path.realpath(os.path.dirname(path))
    roots = [os.path.realpath(d) for d in staging_dirs]
    if not any(folder == root or folder.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
        raise InvalidHiddenStates(
            f"server named a file outside the staging folder(s) {sorted(set(staging_dirs))}; left untouched "
            "(if the server really writes elsewhere, list that folder in vllm.staging_dirs)",
            path,
        )
    for p in (path, path + ".lock"):
        if os.path.islink(p):
            raise InvalidHiddenStates("server named a symlink in the staging folder; left untouched", p)
    if not is_staging_name(os.path.basename(path)):
        raise InvalidHiddenStates(
            "server named a file that is not a hidden-states file of a completion request "
            "(cmpl-<request id>...safetensors); left untouched",
            path,
        )
    return path


def remove_hidden_states(path: str) -> None:
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def validate_hidden_states(
    tensors: dict[str, torch.Tensor],
    prompt: Sequence[int],
    num_layers: int | None = None,
    hidden_size: int | None = None,
    path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check one file's tensors against the prompt sent; returns (token_ids, hidden_states)."""
    missing = {"hidden_states", "token_ids"} - tensors.keys()
    if missing:
        raise InvalidHiddenStates(f"file lacks tensor(s) {sorted(missing)}", path)
    token_ids, hidden = tensors["token_ids"], tensors["hidden_states"]
    if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
        raise InvalidHiddenStates(
            f"token_ids has shape {tuple(token_ids.shape)} / dtype {token_ids.dtype}", path
        )
    if token_ids.tolist() != list(prompt):
        first = next((i for i, (a, b) in enumerate(zip(token_ids.tolist(), prompt)) if a != b), None)
        where = f"first difference at position {first}" if first is not None else "lengths differ"
        raise InvalidHiddenStates(
            f"token_ids in file ({token_ids.numel()} tokens) != prompt ({len(prompt)} tokens), {where}", path
        )
    if hidden.dim() != 3:
        raise InvalidHiddenStates(f"hidden_states has shape {tuple(hidden.shape)}, expected 3 dims", path)
    if hidden.shape[0] != len(prompt):
        raise InvalidHiddenStates(
            f"hidden_states covers {hidden.shape[0]} tokens, prompt has {len(prompt)}", path
        )
    if num_layers is not None and hidden.shape[1] != num_layers:
        raise InvalidHiddenStates(f"hidden_states has {hidden.shape[1]} layers, expected {num_layers}", path)
    if hidden_size is not None and hidden.shape[2] != hidden_size:
        raise InvalidHiddenStates(f"hidden size is {hidden.shape[2]}, expected {hidden_size}", path)
    if not hidden.dtype.is_floating_point:
        raise InvalidHiddenStates(f"hidden_states dtype is {hidden.dtype}", path)
    if not bool(torch.isfinite(hidden).all()):
        bad = int((~torch.isfinite(hidden)).sum())
        raise InvalidHiddenStates(f"hidden_states has {bad} non-finite values", path)
    return token_ids.to(torch.int64), hidden


def read_hidden_states(
    path: str,
    prompt: Sequence[int],
    num_layers: int | None = None,
    hidden_size: int | None = None,
    lock_timeout_s: float = 60.0,
    exclusive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lock, read (safetensors, never pickle), validate, and always delete file and lock."""
    try:
        fd = wait_for_lock(path + ".lock", lock_timeout_s, exclusive)
        try:
            with open(path, "rb") as f:
                data = f.read()  # fully in memory: the file is deleted right after
        except FileNotFoundError:
            raise InvalidHiddenStates("lock released but the hidden-states file is missing", path) from None
        finally:
            os.close(fd)
        try:
            tensors = load_safetensors_bytes(data)
        except (SafetensorError, ValueError, RuntimeError) as err:
            raise InvalidHiddenStates(f"unreadable safetensors file: {err}", path) from None
        return validate_hidden_states(tensors, prompt, num_layers, hidden_size, path)
    finally:
        remove_hidden_states(path)


def discard_hidden_states(path: str, lock_timeout_s: float = 60.0) -> None:
    """Delete a file nobody will read, after the writer is done (or it would recreate it)."""
    try:
        os.close(wait_for_lock(path + ".lock", lock_timeout_s))
    except InvalidHiddenStates:
        pass  # lock not visible here, or never released: delete what we can
    remove_hidden_states(path)


def sweep_stale(folder: str, older_than_s: float, now: float | None = None) -> int:
    """Delete hidden-state files nobody will read: older than ``older_than_s`` and not locked.

    A client killed while its request was in flight never reads (or deletes) the file the
    server writes for it, and the staging folder is often RAM (/dev/shm). The age bound must
    exceed the longest request so that no live request's file is touched; a held lock means
    the server is still writing. Only the connector's names (:data:`STAGING_NAME`) are ever
    deleted, and a folder holding anything else (a model folder given as staging, say) raises
    :class:`ForeignStagingFolder` before anything is touched. Returns how many files were removed.
    """
    now = time.time() if now is None else now
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    temps = {n for n in names if is_writer_temp(folder, n)}
    foreign = sorted(n for n in names if not is_staging_name(n) and n not in temps)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ForeignStagingFolder(
            f"staging folder {folder} holds files draftflow's vLLM servers did not write ({shown}); "
            "nothing in it was deleted. A staging folder must be one of its own (the default "
            "/dev/shm/draftflow-hidden-states): point vllm.launch.staging_dir / vllm.staging_dirs "
            "at an empty folder, or move those files out"
        )
    removed = 0
    for name in names:
        path = os.path.join(folder, name)
        if name in temps:  # no lock: a write in progress renames its temp well within the age bound
            removed += _sweep_writer_temp(path, older_than_s, now)
            continue
        if name.endswith(".lock"):
            removed += _sweep_orphan_lock(path, older_than_s, now)
            continue
        try:
            info = os.lstat(path)  # a symlink is never followed, nor deleted as if it were ours
            if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < older_than_s:
                continue
            fd = os.open(path + ".lock", os.O_RDONLY)
        except FileNotFoundError:  # gone meanwhile, or a server without the lock: age alone decides
            fd = None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            finally:
                os.close(fd)
        if os.path.exists(path):
            remove_hidden_states(path)
            removed += 1
    return removed


def _sweep_writer_temp(path: str, older_than_s: float, now: float) -> int:
    try:
        if now - os.lstat(path).st_mtime < older_than_s:
            return 0
        os.remove(path)
    except FileNotFoundError:  # renamed into place or removed meanwhile
        return 0
    return 1


def _sweep_orphan_lock(lock_path: str, older_than_s: float, now: float) -> int:
    """A lock whose file never came (the request was aborted before the write) or whose file is
    gone: removed once old and not held. A lock beside its file goes with the file."""
    if os.path.lexists(lock_path.removesuffix(".lock")):
        return 0
    try:
        info = os.lstat(lock_path)
        if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < older_than_s:
            return 0
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone meanwhile, or a symlink (O_NOFOLLOW): not ours to delete
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0
    finally:
        os.close(fd)
    try:
        os.remove(lock_path)
    except FileNotFoundError:
        return 0
    return 1
