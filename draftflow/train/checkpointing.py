"""Training checkpoints on any fsspec URL, durable across crashes and resumable.

A checkpoint folder holds the trainable weights (safetensors), the optimizer state, the
RNG states and the data position. Each file is written whole before it becomes visible:
locally to a hidden temporary name, fsync'ed, renamed, then the folder fsync'ed; on an
object store with one PUT (an object appears whole or not at all). The `COMPLETE` marker
is written last and records each file's size and SHA-256, so a checkpoint whose files
were torn by a host crash (or changed later) is recognised on resume: the newest
checkpoint whose files all match is used, and each newer torn one is reported.
Optimizer and RNG files are loaded with `weights_only=True` (tensors and containers, no code).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import secrets
import sys
from dataclasses import asdict, dataclass, field

import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from draftflow.paths import CHECKPOINT_COMPLETE, RunLayout, join, temp_sibling
from draftflow.remote import open_url, url_to_fs

WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "state.json"
MARKER_FORMAT = 1


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    epoch_step: int = 0  # steps done inside that epoch (the data position)


class TornCheckpoint(RuntimeError):
    """A checkpoint whose marker or files do not match (the message names the file)."""


@dataclass
class Resumable:
    """The checkpoint to resume from, its verified file contents, and newer ones found torn."""

    folder: str | None
    step: int | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    torn: list[str] = field(default_factory=list)  # "step-N: reason", newest first


def put_whole(url: str, data: bytes) -> None:
    """Write ``url`` so that it is either absent, its old bytes, or all of ``data``."""
    fs, path = url_to_fs(url)
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)  # one PUT: the object store makes it visible whole
        return
    tmp = temp_sibling(path, secrets.token_hex(6))
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(url: str) -> None:
    """Make the renames inside a local folder durable (no-op on object stores)."""
    fs, path = url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _get(url: str) -> bytes:
    with open_url(url, "rb") as f:
        return f.read()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save(layout: RunLayout, model: torch.nn.Module, optimizer, scheduler, state: TrainState) -> str:
    folder = layout.checkpoint(state.step)
    fs, path = url_to_fs(folder)
    fs.makedirs(path, exist_ok=True)
    marker = join(folder, CHECKPOINT_COMPLETE)
    if fs.exists(join(path, CHECKPOINT_COMPLETE)):  # a rerun of this step: unmark before replacing files
        fs.rm(join(path, CHECKPOINT_COMPLETE))
        _fsync_dir(folder)
    files = _serialise(model, optimizer, scheduler, state)
    for name, data in files.items():
        put_whole(join(folder, name), data)
    _fsync_dir(folder)  # every file durable before the marker that vouches for them
    record = {
        "format": MARKER_FORMAT,
        "step": state.step,
        "files": {name: {"size": len(data), "sha256": _digest(data)} for name, data in files.items()},
    }
    put_whole(marker, json.dumps(record, indent=1).encode())
    _fsync_dir(folder)
    return folder


def _serialise(model, optimizer, scheduler, state: TrainState) -> dict[str, bytes]:
    trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buf)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    rng_buf = io.BytesIO()
    torch.save(rng, rng_buf)
    meta = {"state": asdict(state), "python_random": _py_rng_state()}
    return {
        WEIGHTS: save_safetensors(trainable),
        OPTIMIZER: buf.getvalue(),
        RNG: rng_buf.getvalue(),
        STATE: json.dumps(meta).encode(),
    }


def _py_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def read_verified(folder: str) -> dict[str, bytes]:
    """Every file of a checkpoint, checked against its marker; TornCheckpoint names what differs."""
    try:
        record = json.loads(_get(join(folder, CHECKPOINT_COMPLETE)))
        listed = record["files"]
    except FileNotFoundError:
        raise TornCheckpoint(f"{CHECKPOINT_COMPLETE} is missing") from None
    except (ValueError, KeyError, TypeError):
        raise TornCheckpoint(f"{CHECKPOINT_COMPLETE} is unreadable or has no checksums") from None
    files = {}
    for name, want in listed.items():
        try:
            data = _get(join(folder, name))
        except FileNotFoundError:
            raise TornCheckpoint(f"{name} is missing") from None
        if len(data) != want["size"] or _digest(data) != want["sha256"]:
            raise TornCheckpoint(
                f"{name} has {len(data)} bytes, sha256 {_digest(data)[:12]}…; "
                f"{CHECKPOINT_COMPLETE} records {want['size']} bytes, {want['sha256'][:12]}…"
            )
        files[name] = data
    return files


def marked_steps(layout: RunLayout) -> list[int]:
    """Steps of checkpoint folders holding a marker, newest first."""
    fs, root = url_to_fs(layout.checkpoints_dir)
    if not fs.exists(root):
        return []
    steps = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step-") and fs.exists(f"{entry.rstrip('/')}/{CHECKPOINT_COMPLETE}"):
            steps.append(int(name.removeprefix("step-")))
    return sorted(steps, reverse=True)


def find_resumable(layout: RunLayout) -> Resumable:
    """The newest checkpoint whose files match its marker; newer torn ones are reported on stderr."""
    torn = []
    for step in marked_steps(layout):
        folder = layout.checkpoint(step)
        try:
            files = read_verified(folder)
        except TornCheckpoint as err:
            torn.append(f"step-{step:08d}: {err}")
            print(
                f"draftflow.train: checkpoint {folder} is torn ({err}); falling back to the previous "
                "complete checkpoint",
                file=sys.stderr,
                flush=True,
            )
            continue
        return Resumable(folder, step, files, torn)
    return Resumable(None, None, {}, torn)


def newest_complete(layout: RunLayout) -> str | None:
    return find_resumable(layout).folder


class CheckpointUnreadable(RuntimeError):
    """A rank cannot read the checkpoint that rank 0 chose to resume from."""


def resume(
    layout: RunLayout, runtime, model: torch.nn.Module, optimizer, scheduler
) -> tuple[Resumable, TrainState]:
    """Rank 0 chooses the checkpoint and broadcasts its step; every rank loads that one.

    Ranks that listed the folder themselves could disagree (a marker written between two
    listings, node-local disks), and would then train on different states. If any rank
    cannot read or verify the chosen checkpoint, every rank raises, naming the ranks.
    """
    found = find_resumable(layout) if runtime.is_main else Resumable(None)
    step = runtime.broadcast_int(-1 if found.step is None else found.step)
    if step < 0:
        return found, TrainState()
    folder = layout.checkpoint(step)
    error: Exception | None = None
    files = found.files
    if not runtime.is_main:
        try:
            files = read_verified(folder)
        except (TornCheckpoint, OSError) as err:
            error = err
    failing = runtime.ranks_with(error is not None)
    if failing:
        detail = f": {error}" if error else ""
        raise CheckpointUnreadable(
            f"rank(s) {failing} cannot read checkpoint {folder}, which rank 0 chose to resume from{detail}. "
            "Every rank must see training.run_dir (shared storage); each failing rank logs its reason"
        )
    if runtime.is_main:
        found.folder = folder
    else:
        found = Resumable(folder, step, files)
    return found, apply(files, model, optimizer, scheduler)


def restore(folder: str, model: torch.nn.Module, optimizer, scheduler) -> TrainState:
    return apply(read_verified(folder), model, optimizer, scheduler)


def apply(files: dict[str, bytes], model: torch.nn.Module, optimizer, scheduler) -> TrainState:
    """Load verified checkpoint files into the model, optimizer, scheduler and RNGs."""
    weights = load_safetensors(files[WEIGHTS])
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    opt = torch.load(io.BytesIO(files[OPTIMIZER]), weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = torch.load(io.BytesIO(files[RNG]), weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    meta = json.loads(files[STATE])
    version, internal, gauss = meta["python_random"]
    random.setstate((version, tuple(internal), gauss))
    return TrainState(**meta["state"])
