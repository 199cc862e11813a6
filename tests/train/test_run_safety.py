"""Trainer hardening on the real stack: durable checkpoints, no resume under other settings, one
trainer per run folder, ranks that agree on resume and on SIGTERM, samples that always fail."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from test_trainer import TORCHRUN, TRAIN, _env, _run

from draftflow.extraction import extraction_info
from draftflow.paths import CHECKPOINT_COMPLETE, RunLayout
from draftflow.plan import Plan
from draftflow.sample_source import SampleSource
from draftflow.store import FailedSample, Store, write_shard
from draftflow.train.__main__ import EXIT_INTERRUPTED, EXIT_REFUSED
from draftflow.train.metrics import parse_line

pytestmark = pytest.mark.slow
CHECKPOINT_EVERY_2 = ["--set", "training.checkpoint_every=2"]


def _layout(recipe: str, run_id: str, overrides: list[str] | None = None) -> RunLayout:
    plan = Plan.load(recipe, overrides or [])
    return RunLayout.for_run(plan.recipe.training.run_dir, plan.recipe.name, plan.fingerprint, run_id)


def _complete(layout: RunLayout) -> list[Path]:
    folder = Path(layout.checkpoints_dir)
    return (
        sorted(c for c in folder.iterdir() if (c / CHECKPOINT_COMPLETE).exists()) if folder.exists() else []
    )


def _refused(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == EXIT_REFUSED, (proc.returncode, proc.stderr[-3000:])
    return proc.stderr


def test_torn_newest_checkpoint_falls_back_to_the_previous_one_and_the_run_finishes(train_dir):
    recipe = str(train_dir / "recipe.yaml")
    _run(TRAIN + [recipe, "--run-id", "torn", "--max-steps", "4", "--no-export"] + CHECKPOINT_EVERY_2)
    layout = _layout(recipe, "torn")
    assert [c.name for c in _complete(layout)] == ["step-00000002", "step-00000004"]
    optimizer = Path(layout.checkpoint(4)) / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])  # a torn write

    _, result = _run(TRAIN + [recipe, "--run-id", "torn"] + CHECKPOINT_EVERY_2)
    assert result["resumed_from"].endswith("step-00000002")
    assert len(result["torn_checkpoints"]) == 1 and "optimizer.pt" in result["torn_checkpoints"][0]
    assert result["steps"] > 4 and result["export_dir"]
    marker = json.loads((Path(layout.checkpoint(4)) / CHECKPOINT_COMPLETE).read_text())  # rewritten whole
    assert (
        marker["files"]["optimizer.pt"]["size"]
        == (Path(layout.checkpoint(4)) / "optimizer.pt").stat().st_size
    )


def test_resume_under_changed_training_settings_is_refused_until_a_new_run_is_asked_for(train_dir):
    recipe = str(train_dir / "recipe.yaml")
    base = TRAIN + [recipe, "--run-id", "same"] + CHECKPOINT_EVERY_2
    _run(base + ["--max-steps", "2", "--no-export"])
    layout = _layout(recipe, "same")

    message = _refused(base + ["--set", "training.lr=0.002", "--set", "training.epochs=2"])
    assert "training.lr: 0.001 -> 0.002" in message and "training.epochs: 1 -> 2" in message
    assert "--run-id" in message and "--force-new" in message
    assert [c.name for c in _complete(layout)] == ["step-00000002"]  # nothing was touched

    _, same = _run(base + ["--set", "training.log_every=2", "--max-steps", "3", "--no-export"])
    assert same["resumed_from"].endswith("step-00000002")  # logging settings are not compared

    _, fresh = _run(base + ["--set", "training.lr=0.002", "--force-new", "--max-steps", "2", "--no-export"])
    assert fresh["resumed_from"] is None and fresh["steps"] == 2
    aside = [p for p in Path(layout.root).parent.iterdir() if p.name.startswith("same.replaced-")]
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "step-00000002" / CHECKPOINT_COMPLETE).exists()
    _run(base + ["--set", "training.lr=0.002", "--max-steps", "3", "--no-export"])  # the new run resumes


def test_a_second_trainer_on_the_same_run_id_is_refused(train_dir):
    recipe = str(train_dir / "recipe.yaml")
    first = subprocess.Popen(
        TRAIN + [recipe, "--run-id", "busy", "--set", "training.epochs=5", "--no-export"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    try:
        for line in first.stdout:
            if parse_line(line):
                break  # training: the first trainer holds the run folder
        message = _refused(TRAIN + [recipe, "--run-id", "busy", "--max-steps", "1", "--no-export"])
        assert "in use by another trainer" in message and f'"pid": {first.pid}' in message
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    _, other = _run(
        TRAIN + [recipe, "--run-id", "busy", "--max-steps", "1", "--no-export", "--set", "training.epochs=5"]
    )  # free again once the first one is gone
    assert other["resumed_from"]


def test_a_sample_that_always_fails_is_skipped_within_max_missing_fraction(train_dir):
    recipe = str(train_dir / "recipe.yaml")
    plan = Plan.load(recipe)
    source = SampleSource(plan)
    shard = [sid for sid, _ in source.items()][8:16]  # shard 000001
    samples = source.load(shard)
    bad = shard[3]
    failed = FailedSample(bad, "prompt is longer than the server's max_model_len", samples[3].num_tokens)
    write_shard(
        Store(plan.data),
        "000001",
        samples[:3] + [failed] + samples[4:],
        extraction_info(plan, "offline", "transformers"),
        attempt=2,
    )

    message = _refused(TRAIN + [recipe, "--run-id", "strict", "--max-steps", "1", "--no-export"])
    assert "1 failed" in message and "training.max_missing_fraction" in message

    _, result = _run(TRAIN + [recipe, "--run-id", "lenient", "--set", "training.max_missing_fraction=0.05"])
    assert result["skipped_samples"] == 1 and result["export_dir"] and result["steps"] > 1
    listed = json.loads(Path(_layout(recipe, "lenient").skipped_samples).read_text())
    assert listed == {bad: "extraction failed: prompt is longer than the server's max_model_len"}


def _worker_pids(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0") if ppid == torchrun_pid else []
        except (OSError, IndexError):
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                out[int(entry[5:])] = int(proc.name)
    return out


def test_sigterm_to_one_rank_stops_both_at_one_checkpoint_and_they_resume_together(train_dir):
    recipe = str(train_dir / "recipe.yaml")
    cmd = TORCHRUN + [
        "--nproc-per-node=2",
        "-m",
        "draftflow.train",
        recipe,
        "--run-id",
        "ranks",
        "--set",
        "training.epochs=3",
        "--no-export",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    for line in proc.stdout:
        record = parse_line(line)
        if record and record["step"] >= 2:
            workers = _worker_pids(proc.pid)
            assert sorted(workers) == [0, 1], workers
            os.kill(workers[1], signal.SIGTERM)  # one rank only, as a node's agent or OOM handler might
            break
    try:
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the ranks did not agree on the stop: the job hangs")
    stderr = proc.stderr.read()
    assert stderr.count(f"exitcode  : {EXIT_INTERRUPTED}") == 2, stderr[
        -3000:
    ]  # torchrun's report, both ranks
    layout = _layout(recipe, "ranks")
    (stopped,) = _complete(layout)
    step = int(stopped.name.removeprefix("step-"))

    resume = TORCHRUN + [
        "--nproc-per-node=2",
        "-m",
        "draftflow.train",
        recipe,
        "--run-id",
        "ranks",
        "--set",
        "training.epochs=3",
        "--no-export",
        "--max-steps",
        str(step + 1),
    ]
    done = subprocess.run(resume, check=False, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}/2 resumes from {stopped} (step {step})" in done.stderr, done.stderr[-3000:]


def test_a_rank_that_cannot_read_the_chosen_checkpoint_fails_the_job_clearly(train_dir, tmp_path):
    recipe = str(train_dir / "recipe.yaml")
    _run(
        TORCHRUN
        + [
            "--nproc-per-node=2",
            "-m",
            "draftflow.train",
            recipe,
            "--run-id",
            "local-disks",
            "--max-steps",
            "2",
            "--no-export",
        ]
        + CHECKPOINT_EVERY_2
    )
    # Rank 1 on another node whose training.run_dir is a local disk without the checkpoint.
    elsewhere = tmp_path / "node-1-runs"
    elsewhere.mkdir()
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **_env(),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        extra = ["--set", f"training.run_dir={elsewhere}"] if rank == 1 else []
        procs.append(
            subprocess.Popen(
                TRAIN + [recipe, "--run-id", "local-disks", "--no-export"] + extra,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == EXIT_REFUSED, err[-3000:]
        assert "rank(s) [1] cannot read checkpoint" in err and "step-00000002" in err, err[-3000:]


def _free_port() -> int:
    from draftflow.vllm.launch import free_port

    return free_port()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_run_lock_admits_one_holder_at_a_time(tmp_path, where, request, monkeypatch):
    from draftflow.train.run_state import RunLock, RunLocked

    if where == "s3":
        s3 = request.getfixturevalue("s3")
        monkeypatch.setitem(__import__("fsspec").config.conf, "s3", s3["storage_options"])
        layout = RunLayout(s3["url"] + "/lock-test/run")
    else:
        layout = RunLayout(str(tmp_path / "run"))
    first, second = RunLock(layout), RunLock(layout)
    first.acquire()
    try:
        with pytest.raises(RunLocked, match="in use by another trainer"):
            second.acquire()
    finally:
        first.release()
    second.acquire()  # released: the next trainer gets it
    second.release()
