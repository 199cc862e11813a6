"""The orphan reaper stops only process groups that prove to be the server draftflow launched.

Real processes, no vLLM: a record is only a claim, so each test writes one (as a killed run
would have left it) pointing at a live process group the test started, and checks what
``reap_orphans`` does to it. The real orphaned vLLM server is reaped in
``tests/extraction/test_vllm_lifecycle_real.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from draftflow.process_group import group_alive, group_is_ours, start_time
from draftflow.vllm import lifecycle

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def home(monkeypatch):
    # Outside pytest's private tmp folder: the unprivileged reaper below must reach the records.
    with tempfile.TemporaryDirectory(prefix="draftflow-reaper-") as folder:
        home = Path(folder)
        home.chmod(0o777)
        monkeypatch.setenv("DRAFTFLOW_HOME", str(home))
        yield home


@pytest.fixture
def groups():
    """Start `sleep` process groups (their own session each); kill what is left at the end."""
    started: list[subprocess.Popen] = []

    def start(token: str | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != lifecycle.START_TOKEN_ENV}
        if token:
            env[lifecycle.START_TOKEN_ENV] = token
        # a leader and a child, like the watchdog and vLLM
        proc = subprocess.Popen(
            ["sh", "-c", "sleep 300 & wait"], env=env, start_new_session=True, stdin=subprocess.DEVNULL
        )
        started.append(proc)
        deadline = time.monotonic() + 10
        while len(_members(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def _members(pgid: int) -> list[int]:
    from draftflow.process_group import live_members

    return live_members(pgid)


def dead_launcher() -> tuple[int, float]:
    """The pid and start time of a process that has exited: the killed run's launcher."""
    proc = subprocess.Popen(["sleep", "0.2"])
    started = start_time(proc.pid)
    proc.wait()
    return proc.pid, started


def write_record(home: Path, pgid: int, server_started: float | None, token: str = TOKEN) -> Path:
    folder = home / "run" / "vllm-servers"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o777)
    launcher_pid, launcher_started = dead_launcher()
    path = folder / f"8765-{token}.json"
    path.write_text(
        json.dumps(
            {
                "pgid": pgid,
                "server_started": server_started,
                "port": 8765,
                "host": "127.0.0.1",
                "token": token,
                "model": "/models/x",
                "launcher_pid": launcher_pid,
                "launcher_started": launcher_started,
                "log_path": None,
            }
        )
    )
    path.chmod(0o666)
    return path


def test_a_record_whose_start_time_differs_leaves_the_unrelated_group_running(home, groups):
    other = groups()  # someone else's group that now has the recorded id
    record = write_record(home, other.pid, start_time(other.pid) - 100.0)
    assert lifecycle.reap_orphans(grace_s=2) == []
    assert group_alive(other.pid) and other.poll() is None
    assert not record.exists()  # forgotten: never acted on again


def test_a_record_whose_start_time_matches_but_token_is_absent_leaves_the_group_running(home, groups):
    other = groups()  # no start token in its environment
    record = write_record(home, other.pid, start_time(other.pid))
    assert lifecycle.reap_orphans(grace_s=2) == []
    assert group_alive(other.pid)
    assert not record.exists()


def test_a_group_carrying_another_runs_token_is_not_ours(home, groups):
    other = groups(token="f" * 32)
    write_record(home, other.pid, start_time(other.pid))
    assert lifecycle.reap_orphans(grace_s=2) == []
    assert group_alive(other.pid)


def test_a_group_that_proves_it_is_ours_is_reaped(home, groups):
    orphan = groups(token=TOKEN)
    assert group_is_ours(orphan.pid, start_time(orphan.pid), lifecycle.START_TOKEN_ENV, TOKEN)
    record = write_record(home, orphan.pid, start_time(orphan.pid))
    reaped = lifecycle.reap_orphans(grace_s=2)
    assert [r.pgid for r in reaped] == [orphan.pid]
    orphan.wait(timeout=10)
    assert not group_alive(orphan.pid)
    assert not record.exists()


def test_a_record_older_than_the_bound_is_dropped_without_touching_the_group(home, groups, monkeypatch):
    orphan = groups(token=TOKEN)
    monkeypatch.setattr(lifecycle, "RECORD_MAX_AGE_S", 0.0)
    record = write_record(home, orphan.pid, start_time(orphan.pid))
    time.sleep(0.05)
    assert lifecycle.reap_orphans(grace_s=2) == []
    assert group_alive(orphan.pid)
    assert not record.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop the reaper to another user")
def test_a_group_we_may_not_inspect_or_signal_is_not_ours_and_the_reaper_goes_on(home, groups):
    """An unprivileged reaper (user nobody) meets a root group carrying the very token: it can
    read neither its environment nor signal it, so the group is left alone and the reaper ends
    cleanly, the record forgotten."""
    orphan = groups(token=TOKEN)
    record = write_record(home, orphan.pid, start_time(orphan.pid))
    script = (
        "import logging, os; logging.basicConfig(level=logging.INFO)\n"
        "from draftflow.vllm import lifecycle\n"
        "os.setgid(65534); os.setuid(65534)\n"  # after the imports: the interpreter lives under /root
        "print('reaped', [r.pgid for r in lifecycle.reap_orphans(grace_s=2)])\n"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(repo), "HOME": str(home)},
        cwd=home,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "reaped []" in out.stdout, out.stdout + out.stderr
    assert group_alive(orphan.pid)
    assert not record.exists()
