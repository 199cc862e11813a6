"""Process groups: the pre-exec hook that ties a child to its parent, and the group queries.

Real processes throughout (`sleep`, a Python HTTP server in its own session).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from draftflow import process_group
from draftflow.vllm.launch import free_port


def test_the_pre_exec_hook_loads_nothing_in_the_child(monkeypatch):
    """A child forked from a multi-threaded process (Prefect's) must not dlopen: libc's prctl is
    resolved in the parent, at import, and the hook only calls it."""

    def no_dlopen(*args, **kwargs):
        raise AssertionError("ctypes.CDLL called in the pre-exec hook")

    monkeypatch.setattr(ctypes, "CDLL", no_dlopen)
    process_group.terminate_with_parent()
    process_group.set_parent_death_signal(signal.SIGKILL)


def test_a_child_started_with_the_hook_dies_with_its_parent_even_by_sigkill():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from draftflow.process_group import terminate_with_parent\n"
            "child = subprocess.Popen(['sleep', '300'], preexec_fn=terminate_with_parent)\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(300)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    assert process_group.start_time(child) is not None
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while process_group.start_time(child) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_group.start_time(child) is None, "the child outlived its killed parent"


@pytest.fixture
def listener():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    yield proc, port
    process_group.stop_group(proc, grace_s=5)


def test_group_queries_see_the_listening_group_and_nothing_else(listener):
    proc, port = listener
    assert process_group.group_alive(proc.pid)
    assert process_group.live_members(proc.pid) == [proc.pid]
    assert process_group.group_listens_on(proc.pid, port)
    assert not process_group.group_listens_on(proc.pid, free_port())
    assert not process_group.group_listens_on(os.getpgid(0), port)  # ours does not hold it
    assert "http.server" in process_group.command_line(proc.pid)
    assert process_group.stop_group(proc, grace_s=5)
    assert not process_group.group_alive(proc.pid)
    assert process_group.start_time(proc.pid) is None
