"""Process groups draftflow started: whether they live, whether they are ours, how to stop them.

The one place that looks at other processes (through psutil). A child started with
``start_new_session=True`` leads its own process group, so the group (the child and
everything it spawned, e.g. torchrun's workers or vLLM's engine) can be signalled as one, and
a signal meant for the parent's group never reaches it by surprise.

A group id alone proves nothing: once its processes are gone the id can be reused by anyone.
:func:`group_is_ours` asks for two proofs before anything is signalled: the leader's start
time is the recorded one, and a member still carries the start token draftflow put in its
environment. A process we may not inspect is not ours.

Imported by the vLLM virtualenv's watchdog too: standard library and psutil only (vLLM
depends on psutil).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil

_PR_SET_PDEATHSIG = 1
#: Start times are compared within this: psutil derives them from the boot time, which the
#: kernel reports in whole seconds and moves when the wall clock is stepped. A reused pid
#: started within the same second as the recorded process is not a realistic case, and the
#: start token is the second proof.
START_TIME_TOLERANCE_S = 1.0


def _resolve_prctl() -> Callable | None:
    # Resolved once, in the parent: a child forked from a multi-threaded process must not
    # dlopen (the loader lock may be held by a thread that does not exist in the child).
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _resolve_prctl()


def set_parent_death_signal(sig: int) -> None:
    """In a child before exec: the kernel sends ``sig`` when the parent (thread) dies, even by
    SIGKILL (Linux; elsewhere a no-op). Calls a libc function resolved at import time."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def terminate_with_parent() -> None:
    """Pre-exec hook: SIGTERM when the parent dies."""
    set_parent_death_signal(signal.SIGTERM)


def start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch); None when it is gone, a zombie, or hidden."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def same_start(recorded: float | None, now: float | None) -> bool:
    return recorded is not None and now is not None and abs(recorded - now) <= START_TIME_TOLERANCE_S


def is_running(pid: int, started: float | None) -> bool:
    """True when ``pid`` runs and is the process that started at ``started``."""
    return same_start(started, start_time(pid))


def live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited (zombies left out)."""
    out = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                out.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return out


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count)."""
    return bool(live_members(pgid))


def environment_value(pid: int, name: str) -> str | None:
    """``name`` in ``pid``'s environment; None when unset, gone or not ours to read."""
    try:
        return psutil.Process(pid).environ().get(name)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


def carries_env(pid: int, name: str, value: str) -> bool:
    """Whether ``pid``'s environment has ``name=value``; False when gone or not ours to read."""
    return environment_value(pid, name) == value


def group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def parent_of(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return psutil.Process(pid).ppid()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def group_is_ours(pgid: int, started: float | None, env_name: str, token: str) -> bool:
    """Whether group ``pgid`` is the one draftflow started: its leader, while it lives, started
    at ``started``, and a live member carries ``env_name=token`` in its environment."""
    members = live_members(pgid)
    if not members:
        return False
    if pgid in members and not is_running(pgid, started):
        return False  # the id was reused by a process started at another time
    return any(carries_env(pid, env_name, token) for pid in members)


def command_line(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return []


def group_listens_on(pgid: int, port: int) -> bool:
    """True when a process of group ``pgid`` holds a TCP socket listening on ``port``."""
    for pid in live_members(pgid):
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
            return True
    return False


def listener_of(port: int) -> int | None:
    """The pid of the local process listening on TCP ``port``; None when none is, or it is hidden."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    for c in connections:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return c.pid
    return None


def child_group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of the group our child ``proc`` leads is still running."""
    proc.poll()  # reap our own child, or its zombie would keep the group alive
    return group_alive(proc.pid)


def stop_group(proc: subprocess.Popen, grace_s: float, kill_wait_s: float = 10.0) -> bool:
    """SIGTERM the group ``proc`` leads, SIGKILL what is left after ``grace_s``. True if any was running."""
    if not child_group_alive(proc):
        return False
    signal_group(proc.pid, grace_s, lambda: child_group_alive(proc), kill_wait_s)
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
    the group after the SIGTERM (one its starting parent forks meanwhile) is sent its own.
    Only for groups proved ours (our own child, or :func:`group_is_ours`); a group we may not
    signal raises PermissionError."""
    try:
        told = set(live_members(pgid))
        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive():
        members = live_members(pgid)  # one scan per tick, for both uses
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
