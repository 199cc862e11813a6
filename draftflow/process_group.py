"""Child processes that never outlive the code that started them (POSIX).

A child started with ``start_new_session=True`` leads its own process group, so the group
(the child and everything it spawned, e.g. torchrun's workers) can be signalled as one, and
a signal meant for the parent's group never reaches it by surprise. ``terminate_with_parent``
is a pre-exec hook: the kernel sends the child SIGTERM when its parent dies, even by SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time

_PR_SET_PDEATHSIG = 1


def terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


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
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_alive(proc):
            time.sleep(0.1)
        if not group_alive(proc):
            break
    return True
