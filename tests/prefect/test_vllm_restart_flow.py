"""The Prefect extract flow survives its launched vLLM server dying mid-run: it starts the server
again and retries the shards that were in flight, and the store ends complete, every sample
exactly once. On both task runners: in the flow's threads the shard task restarts the server
itself (the CLI's restart logic, through the server handle); on Dask worker processes the shard
fails and the flow, which holds the handle, restarts the server and runs those shards again."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml
from extraction_helpers import launch_recipe_dict, plant_stale_staging_file, request_count

from draftflow.extraction import expected_samples
from draftflow.plan import Plan
from draftflow.process_group import group_alive, live_members
from draftflow.store import Store, read_manifest, verify
from draftflow.vllm import lifecycle
from draftflow.vllm.launch import free_port

pytestmark = pytest.mark.slow


def api_server_pids(pgid: int) -> list[int]:
    """The vLLM API server of a launched group (not its watchdog, not the engine core)."""
    out = []
    for pid in live_members(pgid):
        try:
            if b"vllm.entrypoints" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


@pytest.mark.slow_ok(reason="two vLLM start-ups per runner (the launch, the restart), and a Dask cluster")
@pytest.mark.parametrize("runner", ["threads", "dask"])
def test_extract_flow_restarts_a_launched_server_killed_mid_run(
    prefect_server, vllm_servers, vllm_python, smollm2_dir: Path, tmp_path: Path, monkeypatch, runner: str
):
    from flows.stages import extract

    vllm_servers.stop()  # one vLLM at a time on this host; the flow launches its own
    monkeypatch.setenv("DRAFTFLOW_HOME", str(tmp_path / "home"))  # this test's launch records only
    port = free_port()
    staging = tmp_path / "staging"
    recipe = launch_recipe_dict(
        smollm2_dir,
        str(tmp_path / "store"),
        port,
        staging,
        vllm_python,
        sources=[{"kind": "chatterbot", "max_samples": 200}],
        num_samples=64,
        eval_samples=4,
        max_length=128,
    )
    recipe["name"] = f"prefect-vllm-restart-{runner}"
    recipe["prefect"] = {"task_runner": runner} | ({"workers": 1} if runner == "dask" else {})
    # One request at a time: the served count climbs one by one, so the killer below lands
    # while many requests are still to come (at 4 in flight a slow /metrics read skipped ~30).
    recipe["extraction"]["concurrency"] = 1
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    plan = Plan.load(str(path))
    store = Store(plan.data)
    seen: dict = {}
    finished = threading.Event()

    def kill_mid_run() -> None:
        """Once the launched server has answered some extraction requests (and has many left),
        kill -9 its API server; then note the server the flow launched in its place."""
        # Triggered on requests served, not samples committed: commits lag the server, and a kill
        # after the last request would leave nothing for a restarted server to do.
        url = f"http://127.0.0.1:{port}"
        # No deadline but the flow's end: the launch may wait long for the CPU host lock.
        while not finished.is_set():
            records = lifecycle.records()
            try:
                served = request_count(url) if records else 0
            except Exception:  # not answering yet
                served = 0
            if 4 <= served <= 48:
                pids = api_server_pids(records[0].pgid)
                if pids:
                    seen["served at kill"] = served
                    seen["killed group"] = records[0].pgid
                    os.kill(pids[0], signal.SIGKILL)
                    break
            time.sleep(0.05)
        while not finished.is_set() and "new group" not in seen:
            fresh = [r.pgid for r in lifecycle.records() if r.pgid != seen.get("killed group")]
            if fresh:
                seen["new group"] = fresh[0]
            time.sleep(0.2)

    staging.mkdir(parents=True, exist_ok=True)
    left = plant_stale_staging_file(staging)  # by a client killed mid-request in an earlier run
    killer = threading.Thread(target=kill_mid_run, daemon=True)
    killer.start()
    try:
        summary = extract(str(path))
    finally:
        finished.set()
        killer.join(timeout=5)

    expected = [e.sample_id for e in expected_samples(plan, store)]
    assert 4 <= seen.get("served at kill", 0) < len(expected), seen  # killed mid-run
    assert seen.get("new group"), seen  # a server was started again
    assert summary.failed == 0
    ids = read_manifest(store)["sample_id"].to_pylist()
    assert sorted(ids) == sorted(expected) and len(set(ids)) == len(ids)  # none lost, none twice
    assert verify(store).ok
    assert not left.exists()  # the Prefect flow sweeps stale staging files, as the CLI does
    # the flow stopped the server it started again; nothing of either launch is left
    assert lifecycle.records() == []
    for group in (seen["killed group"], seen["new group"]):
        assert not group_alive(group), group
    print(
        f"vLLM kill -9 during the extract flow ({runner}): killed with {seen['served at kill']:.0f} of {len(expected)} "
        f"requests served; restarted; {len(ids)}/{len(expected)} samples, 0 lost, 0 duplicated, 0 corrupt"
    )
