"""The run folder's lease on an object store (loopback S3): renewal survives transient store errors,
notices a lease another trainer took (and leaves it alone), and a trainer that cannot renew in time
stops, with a checkpoint when the lease still names it, and a non-zero exit with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import fsspec
import pytest
from test_s3_run_folder import _trainer_env
from test_trainer import TRAIN

from draftflow.paths import CHECKPOINT_COMPLETE, RunLayout
from draftflow.train import EXIT_REFUSED, run_state
from draftflow.train.run_state import RunLock

LEASE_S = 3.0  # renewal every 1 s, given up 2 s after the last renewal


@pytest.fixture
def s3_layout(s3, monkeypatch) -> RunLayout:
    monkeypatch.setitem(fsspec.config.conf, "s3", s3["storage_options"])
    monkeypatch.setattr(run_state, "LEASE_S", LEASE_S)
    return RunLayout(f"{s3['url']}/lease-{uuid.uuid4().hex[:8]}/run")


class StoreFaults:
    """The next `count` reads and writes the lease's heartbeat thread makes fail with OSError (a store
    that drops connections or throttles); calls from any other thread go through."""

    def __init__(self, fs, monkeypatch, count: int):
        self.left, self.raised = count, 0
        for name in ("pipe_file", "cat_file", "info"):
            monkeypatch.setattr(fs, name, self._wrap(getattr(fs, name)))

    def _wrap(self, call):
        def faulty(*args, **kwargs):
            if threading.current_thread().name == "draftflow-run-lease" and self.left > 0:
                self.left -= 1
                self.raised += 1
                raise OSError("injected: connection reset by the store")
            return call(*args, **kwargs)

        return faulty


def _lease(lock: RunLock) -> dict:
    return json.loads(lock.fs.cat_file(lock.path))


@pytest.mark.slow
def test_renewal_survives_transient_store_errors(s3_layout, monkeypatch):
    lock = RunLock(s3_layout)
    lock.acquire()
    try:
        faults = StoreFaults(lock.fs, monkeypatch, count=3)
        time.sleep(3 * LEASE_S)
        assert faults.raised == 3, "the heartbeat did not retry after the first error"
        held = _lease(lock)
        assert held["token"] == lock.owner["token"]
        assert time.time() - held["heartbeat"] < LEASE_S / 2, "the lease was not renewed after the errors"
        assert getattr(lock, "problem", None) is None
    finally:
        lock.release()
    assert not lock.fs.exists(lock.path)


@pytest.mark.slow
def test_a_lease_taken_by_another_trainer_is_noticed_and_left_alone(s3_layout):
    lock = RunLock(s3_layout)
    lock.acquire()
    other = {"host": "other-host", "pid": 4242, "token": "0123456789abcdef", "heartbeat": time.time()}
    lock.fs.pipe_file(lock.path, json.dumps(other).encode())  # a second trainer took the run
    deadline = time.time() + 2 * LEASE_S
    while getattr(lock, "problem", None) is None and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert getattr(lock, "problem", None) is not None, (
            "the first trainer kept the run although another took it"
        )
        assert "another trainer" in lock.problem and "other-host" in lock.problem, lock.problem
        assert _lease(lock)["token"] == other["token"], "the first trainer overwrote the new holder's lease"
        assert not lock.may_write()
    finally:
        lock.release()
    assert _lease(lock)["token"] == other["token"], "releasing removed the other trainer's lease"


@pytest.mark.slow
def test_a_trainer_that_cannot_renew_gives_up_before_its_lease_expires(s3_layout, monkeypatch):
    lock = RunLock(s3_layout)
    lock.acquire()
    try:
        StoreFaults(lock.fs, monkeypatch, count=10**6)
        deadline = time.time() + 2 * LEASE_S
        while getattr(lock, "problem", None) is None and time.time() < deadline:
            time.sleep(0.05)
        noticed = time.time()
        assert getattr(lock, "problem", None) is not None and "could not renew" in lock.problem, lock.problem
        assert noticed - _lease(lock)["heartbeat"] < LEASE_S, "gave up only after others could take the run"
        assert lock.may_write(), "the lease still names this trainer: its last checkpoint may be written"
    finally:
        lock.release()


# -- the trainer ------------------------------------------------------------------------------------

TRAINER = """
import sys, threading
import s3fs
from draftflow.train import run_state
run_state.LEASE_S = float(sys.argv[1])
if sys.argv[2] == "lease-writes-fail":  # the store refuses every renewal of the lease object
    put = s3fs.S3FileSystem.pipe_file
    def pipe_file(self, path, *args, **kwargs):
        if threading.current_thread().name == "draftflow-run-lease" and path.endswith("/.lock"):
            raise OSError("injected: access denied to the lease object")
        return put(self, path, *args, **kwargs)
    s3fs.S3FileSystem.pipe_file = pipe_file
from draftflow.train.__main__ import main
sys.exit(main(sys.argv[3:]))
"""


def _start_trainer(train_dir, s3, run_id: str, lease_s: float, fault: str) -> tuple[subprocess.Popen, str]:
    runs = f"{s3['url']}/lease-trainer-{uuid.uuid4().hex[:8]}/runs"
    recipe = str(train_dir / "recipe.yaml")
    args = [recipe, "--run-id", run_id, "--set", f"training.run_dir={runs}", "--set", "training.epochs=200"]
    assert TRAIN[1:] == ["-m", "draftflow.train"]
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(TRAINER), str(lease_s), fault, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_trainer_env(s3["storage_options"]),
    )
    return proc, runs


def _run_layout(fs, runs: str) -> RunLayout:
    """The single run folder under `runs`, once its trainer holds the lease and recorded the run."""
    deadline = time.time() + 120
    while time.time() < deadline:
        recorded = fs.glob(runs.removeprefix("s3://") + "/**/run.json")
        if recorded:
            return RunLayout("s3://" + recorded[0].rsplit("/", 1)[0])
        time.sleep(0.2)
    raise AssertionError(f"no trainer recorded a run under {runs}")


@pytest.mark.slow
def test_a_trainer_whose_run_another_trainer_took_stops_without_writing_to_it(train_dir, s3):
    fs = fsspec.filesystem("s3", **s3["storage_options"])
    proc, runs = _start_trainer(train_dir, s3, "taken", 3.0, "no-fault")
    try:
        layout = _run_layout(fs, runs)
        other = {"host": "other-host", "pid": 4242, "token": "0123456789abcdef", "heartbeat": time.time()}
        fs.pipe_file(layout.lock, json.dumps(other).encode())  # a second trainer takes the run
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_REFUSED, err[-3000:]
    assert "another trainer" in err and "other-host" in err and "lease" in err, err[-3000:]
    assert json.loads(fs.cat_file(layout.lock))["token"] == other["token"], "its lease was overwritten"
    assert "nothing more was written" in err.lower(), err[-3000:]


@pytest.mark.slow
def test_a_trainer_that_cannot_renew_its_lease_checkpoints_and_exits_non_zero(train_dir, s3):
    fs = fsspec.filesystem("s3", **s3["storage_options"])
    proc, runs = _start_trainer(train_dir, s3, "unrenewable", 30.0, "lease-writes-fail")
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_REFUSED, err[-3000:]
    assert "could not renew" in err and "lease" in err, err[-3000:]
    layout = _run_layout(fs, runs)
    checkpoints = fs.glob(layout.checkpoints_dir.removeprefix("s3://") + f"/step-*/{CHECKPOINT_COMPLETE}")
    assert checkpoints, "no checkpoint was written before the trainer stopped"
    assert max(checkpoints).split("/")[-2] in err, "the message names the checkpoint it wrote last"
