"""Cancelling a training flow run on a real Prefect server stops torchrun and its workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prefect_helpers import train_fixtures, trigger, wait_final

from draftflow.paths import CHECKPOINT_COMPLETE, RunLayout
from draftflow.plan import Plan

pytestmark = pytest.mark.slow


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_cancelling_the_train_flow_run_leaves_no_torchrun_running(
    prefect_server, start_runner, smollm2_dir, tmp_path
):
    fixtures = train_fixtures()
    recipe = str(fixtures.write_recipe(tmp_path))
    plan = Plan.load(recipe)
    fixtures.fill_store(plan, smollm2_dir)
    runner = start_runner(
        [
            {
                "flow": "flows.stages:train",
                "name": "cancel-train",
                "parameters": {"recipe": recipe, "overrides": ["training.epochs=50"], "run_id": "cancelled"},
            }
        ],
        env={"OMP_NUM_THREADS": "1"},
    )
    run_id = trigger(runner.deployment_names[0])
    metrics = Path(
        RunLayout.for_run(
            plan.recipe.training.run_dir, plan.recipe.name, plan.fingerprint, "cancelled"
        ).metrics
    )
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # torchrun is training
        assert time.monotonic() < deadline, runner.output()[-3000:]
        time.sleep(1)
    assert _processes_mentioning(recipe), "torchrun and its worker run with the recipe on their command line"

    try:
        answer = httpx.post(
            f"{prefect_server.api_url}/flow_runs/{run_id}/set_state",  # the UI's Cancel
            json={"state": {"type": "CANCELLING", "message": "cancelled from the UI"}},
            timeout=30,
        )
        assert answer.json()["status"] == "ACCEPT", answer.text
        final = wait_final(run_id, timeout_s=120)
        assert final.state.type.value == "CANCELLED", runner.output()[-3000:]
        survivors = _processes_mentioning(recipe)
        assert survivors == [], f"training processes outlived the cancelled flow run: {survivors}"
        done = [
            c
            for c in Path(
                RunLayout.for_run(
                    plan.recipe.training.run_dir, plan.recipe.name, plan.fingerprint, "cancelled"
                ).checkpoints_dir
            ).glob("step-*")
            if (c / CHECKPOINT_COMPLETE).exists()
        ]
        assert done, "the stopped trainer saved a checkpoint to resume from"
    finally:
        for pid in _processes_mentioning(recipe):  # never leave a test's trainer behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
