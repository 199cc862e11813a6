"""Process-level set-up for training: ranks, device, backend, precision — one code path.

CPU: gloo, fp32. GPU: NCCL, bf16 autocast. The device is chosen once at start
(`training.device`: auto | cpu | cuda); nothing else in the trainer branches on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the ranks, in place. NCCL reduces CUDA tensors only (a CPU
        one fails: "No backend type associated with device type cpu"), so a tensor elsewhere
        is reduced on the collective device and copied back."""
        if self.distributed:
            moved = value.to(self._collective_device)
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            if moved is not value:
                value.copy_(moved)
        return value

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self._collective_device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def ranks_with(self, flag: bool) -> list[int]:
        """The ranks whose ``flag`` is set, known to every rank (one all-reduce)."""
        if not self.distributed:
            return [0] if flag else []
        t = torch.zeros(self.world_size, dtype=torch.long, device=self._collective_device)
        t[self.rank] = int(bool(flag))
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [r for r in range(self.world_size) if t[r]]

    @property
    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("training.device=cuda but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_runtime(preference: str = "auto") -> Runtime:
    """Read torchrun's environment (or run as a single process) and join the process group."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(preference, local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    if device.type == "cpu" and world > 1:
        # Ranks share their node's cores (those this process may run on: a container's cpuset or
        # taskset, not the host's count) with the other ranks of that node only; oversubscription
        # makes every rank slower, and dividing by the world size starves multi-node runs.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // local_world))
    if device.type == "cpu":
        reuse_freed_memory()
    return Runtime(rank, world, local_rank, device)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BYTES = 1 << 30


def reuse_freed_memory() -> bool:
    """Make glibc keep freed memory for the next allocation instead of unmapping it.

    A training step frees and re-allocates the same large tensors every step. glibc maps
    every allocation above its mmap threshold (at most 32 MiB, by default) afresh and unmaps
    it on free, so each step faults all those pages in again and the kernel zeroes them, a
    cost that grows with the pack. Costs the process's peak heap staying resident until exit
    (a few percent more peak RSS). False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    # allocations up to 1 GiB come from the heap; a free never trims it
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))


def shutdown(runtime: Runtime) -> None:
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()
