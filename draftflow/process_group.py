"""Child processes that never outlive the code that started them (POSIX).

A child started with ``start_new_session=True`` leads its own process group, so the group
(the child and everything it spawned, e.g. torchrun's workers) can be signalled as one, and
a signal meant for the parent's group never reaches it by surprise. ``terminate_with_parent``
is a pre-exec hook: the kernel sends the child SIGTERM when its parent dies, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def live_members(pgid: int) -> list[int]:
    """The processes of group `pgid` that have not exited (zombies left out; Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of the group ``proc`` leads is still running."""
    proc.poll()  # reap our own child, or its zombie would keep the group alive
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(proc: subprocess.Popen, grace_s: float, kill_wait_s: float = 10.0) -> bool:
    """SIGTERM the group ``proc`` leads, SIGKILL what is left after ``grace_s``. True if any was running."""
    if not group_alive(proc):
        return False
    signal_group(proc.pid, grace_s, lambda: group_alive(proc), kill_wait_s)
    return True


def signal_group(
    pgid: int,
    grace_s: float,
    alive: Callable[[], bool],
    kill_wait_s: float = 10.0,
    no_point_waiting: Callable[[list[int]], bool] | None = None,
) -> None:
    """SIGTERM (and SIGCONT: a stopped process acts on it only once continued) the group, then
    SIGKILL what is left after ``grace_s``, or as soon as ``no_point_waiting(live members)``;
    return once ``alive()`` is False or ``kill_wait_s`` after the SIGKILL. A process that joins
    the group after the SIGTERM (one its starting parent forks meanwhile) is sent its own."""
    try:
        told = set(live_members(pgid))
        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive():
        members = live_members(pgid)  # one /proc scan per tick, for both uses
        if no_point_waiting is not None and no_point_waiting(members):
            break
        for pid in set(members) - told:
            told.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        time.sleep(0.1)
    if not alive():
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + kill_wait_s
    while time.monotonic() < deadline and alive():
        time.sleep(0.1)
