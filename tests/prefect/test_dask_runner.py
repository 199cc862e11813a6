"""`prefect.task_runner: dask`: extraction shard tasks on Dask worker processes (prefect-dask),
on the real Prefect server and the real SmolLM2 extraction server.

- a local cluster of 2 worker processes, started by the flow: the shards spread over both, the
  manifest is complete and has every sample once;
- an external cluster (`prefect.address`) whose worker is SIGKILLed mid-shard (samples extracted,
  nothing committed): Dask re-runs the shard on another worker, nothing is duplicated or partial;
- an address where no scheduler answers: one error naming `prefect.address`, before the flow
  prepares data or checks / starts a vLLM server.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from prefect_helpers import shard_table_rows, task_runs, write_tiny_recipe
from test_kill9_real import assert_nothing_partial

from draftflow.extraction import expected_samples
from draftflow.extraction.faults import HOLD_DIR_ENV, HOLD_SHARDS_ENV
from draftflow.plan import Plan
from draftflow.store import Store, read_manifest
from draftflow.vllm.launch import free_port

HELD = "000002"


def _recipe(tmp_path: Path, smollm2_dir: Path, endpoint: str, staging: Path, name: str, prefect: dict) -> str:
    return write_tiny_recipe(
        tmp_path / "recipe.yaml",
        smollm2_dir,
        str(tmp_path / "store"),
        endpoint,
        name=name,
        staging=str(staging),
        prefect=prefect,
    )


def _complete_once(recipe: str) -> list[str]:
    """Every expected sample is in the manifest exactly once, in shard order, and nothing partial
    is visible; returns the shard ids."""
    plan = Plan.load(recipe)
    store = Store(plan.data)
    ids = [e.sample_id for e in expected_samples(plan, store)]
    assert read_manifest(store)["sample_id"].to_pylist() == ids
    assert_nothing_partial(store, set(ids))
    return sorted(set(read_manifest(store)["shard_id"].to_pylist()))


def _shard_task_states(flow_run_id) -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for t in task_runs(flow_run_id):
        if t.name.startswith("extract-"):
            states.setdefault(t.name.removeprefix("extract-"), []).append(t.state.name)
    return states


@pytest.mark.slow
def test_shards_spread_over_the_local_cluster_workers(
    prefect_server, extraction_endpoint, staging_dir, smollm2_dir: Path, tmp_path: Path
):
    from flows.stages import extract

    recipe = _recipe(
        tmp_path,
        smollm2_dir,
        extraction_endpoint,
        staging_dir,
        "prefect-dask-local",
        {"task_runner": "dask", "workers": 2},
    )
    started = time.monotonic()
    state = extract(recipe, return_state=True)
    assert state.is_completed(), state.message
    assert state.result().failed == 0
    shards = _complete_once(recipe)
    assert len(shards) == 5

    rows = shard_table_rows("prefect-dask-local-shards", state.state_details.flow_run_id)
    ran_on = {s: r["ran on"] for s, r in rows.items()}
    assert sorted(ran_on) == shards and all(r["status"] == "extracted" for r in rows.values())
    workers = {where.split(" ")[0] for where in ran_on.values()}
    pids = {where.rsplit("pid ", 1)[1].rstrip(")") for where in ran_on.values()}
    assert all(w.startswith("tcp://") for w in workers), ran_on  # Dask workers, not the flow process
    assert len(workers) >= 2 and len(pids) >= 2 and str(os.getpid()) not in pids, ran_on
    # one task run per shard, each completed once (no duplicate runs recorded on the server)
    assert _shard_task_states(state.state_details.flow_run_id) == {s: ["Completed"] for s in shards}
    print(
        f"2-worker local cluster: {len(shards)} shards on {sorted(workers)} in {time.monotonic() - started:.1f} s"
    )


@pytest.mark.slow
def test_worker_killed_mid_shard_reruns_it_without_duplicates(
    prefect_server,
    extraction_endpoint,
    staging_dir,
    smollm2_dir: Path,
    tmp_path: Path,
    monkeypatch,
):
    from distributed import Client, LocalCluster

    from flows.stages import extract

    hold_dir = tmp_path / "held"
    # Inherited by the worker processes the cluster spawns: shard HELD's first attempt records its
    # pid and waits, after its samples are extracted and before anything is committed.
    monkeypatch.setenv(HOLD_SHARDS_ENV, HELD)
    monkeypatch.setenv(HOLD_DIR_ENV, str(hold_dir))
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        recipe = _recipe(
            tmp_path,
            smollm2_dir,
            extraction_endpoint,
            staging_dir,
            "prefect-dask-kill",
            {"task_runner": "dask", "address": cluster.scheduler_address},
        )
        worker_pids = set(client.run(os.getpid).values())
        killed: list[int] = []

        def kill_the_holder() -> None:
            marker = hold_dir / f"{HELD}.held"
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if marker.exists() and marker.read_text():
                    pid = int(marker.read_text())
                    killed.append(pid)
                    os.kill(pid, signal.SIGKILL)
                    return
                time.sleep(0.1)

        killer = threading.Thread(target=kill_the_holder, daemon=True)
        killer.start()
        state = extract(recipe, return_state=True)
        killer.join(5)
        assert state.is_completed(), state.message
        assert state.result().failed == 0

    assert len(killed) == 1 and killed[0] in worker_pids, (killed, worker_pids)  # a Dask worker died
    shards = _complete_once(recipe)
    assert len(shards) == 5
    rows = shard_table_rows("prefect-dask-kill-shards", state.state_details.flow_run_id)
    held = rows[HELD]["ran on"]
    # re-run whole by another worker process (the attempt that was killed never reached the store)
    assert rows[HELD]["status"] == "extracted" and f"pid {killed[0]})" not in held, held
    manifest = read_manifest(Store(Plan.load(recipe).data))
    assert set(manifest.filter(pc.equal(manifest["shard_id"], HELD))["attempt"].to_pylist()) == {1}
    # Still one task run per shard. Dask also re-runs the tasks whose results lived in the dead
    # worker's memory: those find their persisted result (Cached) and ask vLLM nothing.
    states = _shard_task_states(state.state_details.flow_run_id)
    assert sorted(states) == shards and states[HELD] == ["Completed"], states
    assert all(s in (["Completed"], ["Cached"]) for s in states.values()), states
    print(f"killed worker pid {killed[0]} mid-shard {HELD}; re-ran on {held}; task states {states}")


@pytest.mark.slow
def test_dead_scheduler_address_fails_first_naming_the_field(
    prefect_server, smollm2_dir: Path, tmp_path: Path
):
    from flows.stages import extract

    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    # A vLLM endpoint that does not answer either, and no launch section: had the flow got past
    # the check, preparation would fail on vLLM instead.
    recipe = _recipe(
        tmp_path,
        smollm2_dir,
        "http://127.0.0.1:9",
        tmp_path / "staging",
        "prefect-dask-dead",
        {"task_runner": "dask", "address": address},
    )
    started = time.monotonic()
    state = extract(recipe, return_state=True)
    took = time.monotonic() - started
    assert state.is_failed()
    message = state.message or ""
    assert message.count(f"prefect.address: no Dask scheduler answers at {address}") == 1, message
    assert "\n" not in str(state.result(raise_on_failure=False))
    names = sorted(t.name.rsplit("-", 1)[0] for t in task_runs(state.state_details.flow_run_id))
    assert names == ["check-task-runner", "resolve-recipe"], names  # no prepare-data, no check-or-start-vllm
    print(f"dead scheduler address: failed after {took:.1f} s: {message}")
