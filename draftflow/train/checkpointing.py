"""Training checkpoints on any fsspec URL, resumable after a crash.

A checkpoint folder holds the trainable weights (safetensors), the optimizer state, the
RNG states and the data position. The `COMPLETE` marker is written last: a folder
without it is a checkpoint that died half-way and is never resumed from. Optimizer and
RNG files are loaded with `weights_only=True` (tensors and plain containers, no code).
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import asdict, dataclass

import fsspec
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from draftflow.paths import CHECKPOINT_COMPLETE, RunLayout, join

WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "state.json"


@dataclass
class TrainState:
    step: int = 0        # optimizer steps done
    epoch: int = 0       # epoch in progress
    epoch_step: int = 0  # steps done inside that epoch (the data position)


def _put(url: str, data: bytes) -> None:
    with fsspec.open(url, "wb") as f:
        f.write(data)


def _get(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def save(layout: RunLayout, model: torch.nn.Module, optimizer, scheduler, state: TrainState) -> str:
    folder = layout.checkpoint(state.step)
    fs, path = fsspec.core.url_to_fs(folder)
    fs.makedirs(path, exist_ok=True)
    trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    _put(join(folder, WEIGHTS), save_safetensors(trainable))
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buf)
    _put(join(folder, OPTIMIZER), buf.getvalue())
    buf = io.BytesIO()
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, buf)
    _put(join(folder, RNG), buf.getvalue())
    meta = {"state": asdict(state), "python_random": _py_rng_state()}
    _put(join(folder, STATE), json.dumps(meta).encode())
    _put(join(folder, CHECKPOINT_COMPLETE), b"ok\n")
    return folder


def _py_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def newest_complete(layout: RunLayout) -> str | None:
    fs, root = fsspec.core.url_to_fs(layout.checkpoints_dir)
    if not fs.exists(root):
        return None
    done = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step-") and fs.exists(f"{entry.rstrip('/')}/{CHECKPOINT_COMPLETE}"):
            done.append((int(name.removeprefix("step-")), name))
    if not done:
        return None
    return join(layout.checkpoints_dir, max(done)[1])


def restore(folder: str, model: torch.nn.Module, optimizer, scheduler) -> TrainState:
    weights = load_safetensors(_get(join(folder, WEIGHTS)))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    opt = torch.load(io.BytesIO(_get(join(folder, OPTIMIZER))), weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = torch.load(io.BytesIO(_get(join(folder, RNG))), weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    meta = json.loads(_get(join(folder, STATE)))
    version, internal, gauss = meta["python_random"]
    random.setstate((version, tuple(internal), gauss))
    return TrainState(**meta["state"])
