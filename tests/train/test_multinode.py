"""Multi-node training on one host: two "nodes" x one gloo process, each started by its own
`draftflow train --node-rank K` (as two machines would), joined by torchrun's c10d rendezvous
on loopback, with the run folder declared shared (it is: one host)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run_safety import _complete, _layout, _worker_pids
from test_trainer import _env, _run

from draftflow.paths import CHECKPOINT_COMPLETE
from draftflow.train import RESULT_PREFIX
from draftflow.train.metrics import parse_line
from draftflow.vllm.launch import free_port

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "flows.cli", "train"]  # the `draftflow` entry point


def _multinode() -> list[str]:
    return [
        "--set",
        "training.nnodes=2",
        "--set",
        f"training.rdzv_endpoint=127.0.0.1:{free_port()}",
        "--set",
        "training.run_dir_shared=true",
    ]


class Node:
    """One node's `draftflow train` (it becomes torchrun), in its own session like a machine."""

    def __init__(self, folder: Path, rank: int, cmd: list[str]):
        self.out = open(folder / f"node{rank}.out", "w+")  # files: no pipe fills while we wait on the other
        self.err = open(folder / f"node{rank}.err", "w+")
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=self.err, text=True, env=_env(), start_new_session=True
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"node did not finish within {timeout} s:\n{self.stderr()[-3000:]}")

    def kill_machine(self) -> None:
        """kill -9 of the node's worker and its torchrun: the machine is gone. Each separately:
        torchrun starts every worker in a session of its own, out of reach of killpg."""
        workers = _worker_pids(self.proc.pid)
        assert workers, "node has no worker process"
        for pid in workers.values():
            os.kill(pid, signal.SIGKILL)
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stdout(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()


def _start_nodes(folder: Path, recipe: str, run_id: str, settings: list[str]) -> list[Node]:
    multinode = _multinode()
    return [
        Node(folder, k, CLI + [recipe, "--node-rank", str(k), "--run-id", run_id, *multinode, *settings])
        for k in (0, 1)
    ]


def _finish(nodes: list[Node], timeout: float = 300) -> tuple[list[dict], dict]:
    """Both nodes succeed; exactly one (global rank 0's) printed the metrics and the result."""
    for node in nodes:
        assert node.wait(timeout) == 0, node.stderr()[-3000:]
    outputs = [node.stdout() for node in nodes]
    with_result = [o for o in outputs if RESULT_PREFIX in o]
    assert len(with_result) == 1, outputs
    lines = with_result[0].splitlines()
    result = json.loads(next(ln for ln in lines if ln.startswith(RESULT_PREFIX))[len(RESULT_PREFIX) :])
    return [m for m in map(parse_line, lines) if m], result


def _same_curve(reference: list[dict], run: list[dict]) -> None:
    by_step = {m["step"]: m for m in reference}
    assert run
    for b in run:
        a = by_step[b["step"]]
        # Same global batch, data order and anchors: the same updates, whichever node holds rank 0;
        # only the order of float additions in the all-reduce may differ.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (a, b)
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-3)


def test_two_nodes_train_like_one_node_of_two_processes_and_resume_together_after_a_node_is_killed(
    train_dir,
):
    """One test, three jobs (each job start costs ~15 s here): the 1-node x 2-process reference, a
    2-node x 1-process job whose node 1 is killed (-9, torchrun and its worker: a lost machine)
    after the step-4 checkpoint, and the rerun of both nodes. Every step either 2-node job logged
    must match the reference, so the two nodes train exactly like one node, before and after resume."""
    recipe = str(train_dir / "recipe.yaml")
    settings = [
        "--set",
        "training.batch_size=1",
        "--set",
        "training.checkpoint_every=2",
        "--set",
        "training.epochs=2",
        "--set",
        "training.validation_fraction=0",  # validation across ranks is tested in test_trainer
        "--no-export",
    ]
    timings = {}
    started = time.monotonic()
    reference, _ = _run(CLI + [recipe, "--run-id", "one-node", "--set", "training.nproc=2", *settings])
    timings["1 node x 2 processes"] = time.monotonic() - started

    started = time.monotonic()
    nodes = _start_nodes(train_dir, recipe, "two-nodes", settings)
    layout = _layout(recipe, "two-nodes")
    second = Path(layout.checkpoint(4)) / CHECKPOINT_COMPLETE
    deadline = time.monotonic() + 240
    while not second.exists():
        assert time.monotonic() < deadline, nodes[0].stderr()[-3000:] + nodes[1].stderr()[-3000:]
        assert all(n.proc.poll() is None for n in nodes), (
            nodes[0].stderr()[-3000:] + nodes[1].stderr()[-3000:]
        )
        time.sleep(0.1)
    nodes[1].kill_machine()
    killed_at = time.monotonic()
    # The survivor's collective fails on the lost peer: torchrun must end, not wait forever.
    assert nodes[0].wait(timeout=180) != 0
    timings["survivor stopped after"] = time.monotonic() - killed_at
    timings["2 nodes until killed"] = time.monotonic() - started
    before_kill = [m for n in nodes for m in map(parse_line, n.stdout().splitlines()) if m]
    assert [m["step"] for m in before_kill][:4] == [1, 2, 3, 4]
    _same_curve(reference, before_kill)
    stopped = _complete(layout)[-1]
    step = int(stopped.name.removeprefix("step-"))
    assert step >= 4

    started = time.monotonic()
    rerun = _start_nodes(train_dir, recipe, "two-nodes", settings)
    after_resume, result = _finish(rerun)
    timings["2 nodes, resumed run"] = time.monotonic() - started
    print(", ".join(f"{k}: {v:.1f} s" for k, v in timings.items()))
    stderr = rerun[0].stderr() + rerun[1].stderr()
    for rank in (0, 1):
        assert f"rank {rank}/2 resumes from {stopped} (step {step})" in stderr, stderr[-3000:]
    assert result["resumed_from"].endswith(stopped.name)
    assert [m["step"] for m in after_resume] == [m["step"] for m in reference if m["step"] > step]
    _same_curve(reference, after_resume)
    assert result["steps"] == reference[-1]["step"] >= 8
