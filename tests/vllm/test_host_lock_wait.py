"""Waiting for the host's vLLM lock never keeps a stopped process alive.

The wait runs in a task's worker thread; when the main thread ends (SIGTERM to `draftflow demo`
while its evaluation waited for another process's server), the interpreter joins that thread before
exiting, so a wait that ignored it kept the process alive for the lock's whole timeout.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

WAITER = """
import concurrent.futures, sys
from draftflow.vllm.launch import CPU_HOST_LOCK, wait_for_host_lock
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(wait_for_host_lock, CPU_HOST_LOCK, 120.0)
print("waiting", flush=True)
sys.exit(143)  # the main thread ends, as after SIGTERM; the worker is still waiting
"""


def test_a_process_whose_main_thread_ended_stops_waiting_for_the_host_lock(tmp_path: Path):
    lock = tmp_path / "draftflow-vllm-cpu-host.lock"  # the waiter's TMPDIR: not the host's real lock
    held = open(lock, "a+")
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's server holds it
    try:
        started = time.monotonic()
        waiter = subprocess.run(
            [sys.executable, "-c", WAITER],
            env={**os.environ, "TMPDIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - started
    finally:
        held.close()
    assert waiter.stdout.strip() == "waiting" and waiter.returncode == 143, waiter.stderr[-2000:]
    assert took < 15, f"the process stayed {took:.0f} s after its main thread ended"
    assert "another vLLM server runs on this CPU host" in waiter.stderr
