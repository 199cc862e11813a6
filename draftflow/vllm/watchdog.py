"""``python -m draftflow.vllm.watchdog FD -- CMD...``: run a vLLM server that dies with its launcher.

Run by the vLLM virtualenv's Python, so it imports only the standard library and draftflow's
standard-library-only modules. The launcher keeps the write end of a pipe whose read end is
``FD``; the kernel closes it when the launcher exits in any way (``kill -9`` included), and
EOF here stops the server's whole process group (SIGTERM, then SIGKILL after a grace period).

Why a pipe and not ``prctl(PR_SET_PDEATHSIG)`` in the launcher: the parent-death signal
fires when the *thread* that forked exits, and Prefect runs tasks in worker threads, so a
server started from a task would be killed when that thread ends. This watchdog is
single-threaded, so between it and vLLM the parent-death signal is safe, and it is used:
a ``kill -9`` of the watchdog itself takes vLLM down too.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from draftflow.process_group import set_parent_death_signal, signal_group
from draftflow.vllm.engine_exit import engine_gone_for

GRACE_S = 20.0


def _in_child() -> None:
    """In vLLM's process before exec: default signal handling (ignored signals would stay ignored
    across exec) and SIGKILL when this watchdog dies."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    set_parent_death_signal(signal.SIGKILL)


def stop_group(child: subprocess.Popen) -> None:
    """SIGTERM the group (this process ignores it), SIGKILL what is left after the grace period,
    or once vLLM's engine has gone and the API server has not followed (engine_exit). The SIGKILL
    ends this process too."""
    group = os.getpgid(0)
    signal_group(group, GRACE_S, lambda: child.poll() is None, no_point_waiting=engine_gone_for())
    time.sleep(1.0)  # vLLM's engine processes outlive the API server by a moment
    os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m draftflow.vllm.watchdog FD -- CMD...", file=sys.stderr)
        return 2
    fd, cmd = int(argv[0]), argv[2:]
    # The launcher stops the server with SIGTERM to the whole group: the watchdog stays until
    # vLLM is gone, then exits with its code.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen(cmd, preexec_fn=_in_child)
    while True:
        if child.poll() is not None:
            return child.returncode if child.returncode >= 0 else 128 - child.returncode
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready and not os.read(fd, 64):  # EOF: the launcher is gone
            print("draftflow watchdog: the launcher exited; stopping vLLM", file=sys.stderr, flush=True)
            stop_group(child)
            return 137


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
