"""Retry from the UI: a served extraction deployment fails on two shards; the UI's Retry re-runs the
same flow run, and only those two shards' samples are requested from vLLM again. The same with
the shard tasks on a 2-process Dask cluster the flow starts (`prefect.task_runner: dask`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from extraction_helpers import request_count
from prefect_helpers import retry_from_ui, shard_table_rows, task_runs, trigger, wait_final, write_tiny_recipe

from draftflow.extraction import expected_samples
from draftflow.plan import Plan
from draftflow.store import Store, read_manifest, verify

pytestmark = pytest.mark.slow

FAILING = ("000001", "000003")
PROBES_PER_RUN = 1  # check-or-start probes each endpoint once per flow run (one extraction request)


@pytest.mark.parametrize("runner", ["threads", "dask"])
def test_retry_from_ui_reextracts_only_the_failed_shards(
    prefect_server,
    start_runner,
    extraction_endpoint,
    staging_dir,
    smollm2_dir: Path,
    tmp_path: Path,
    runner: str,
):
    name = f"prefect-ui-retry-{runner}"
    recipe = write_tiny_recipe(
        tmp_path / "recipe.yaml",
        smollm2_dir,
        str(tmp_path / "store"),
        extraction_endpoint,
        name=name,
        staging=str(staging_dir),
        prefect={"task_runner": "dask", "workers": 2} if runner == "dask" else None,
    )
    served = start_runner(
        [{"flow": "flows.stages:extract", "name": f"ui-retry-{runner}", "parameters": {"recipe": recipe}}],
        env={
            "DRAFTFLOW_TEST_FAIL_SHARDS": ",".join(FAILING),
            "DRAFTFLOW_TEST_FAIL_ONCE_DIR": str(tmp_path / "once"),
        },
    )

    before = request_count(extraction_endpoint)
    run_id = trigger(served.deployment_names[0])
    first = wait_final(run_id)
    after_failure = request_count(extraction_endpoint)
    assert first.state.type.value == "FAILED", served.output()[-3000:]
    assert "2 of 5 shards failed" in first.state.message

    plan = Plan.load(recipe)
    store = Store(plan.data)
    ids = [e.sample_id for e in expected_samples(plan, store)]
    assert len(ids) == 20
    per = plan.recipe.extraction.samples_per_shard
    failing_samples = [sid for k, sid in enumerate(ids) if f"{k // per:06d}" in FAILING]
    # every sample was requested once (the failing shards fail after extracting, before writing)
    assert after_failure - before == PROBES_PER_RUN + len(ids)
    assert sorted(set(read_manifest(store)["shard_id"].to_pylist())) == ["000000", "000002", "000004"]

    answer = retry_from_ui(prefect_server.api_url, run_id)
    assert answer["status"] == "ACCEPT", answer
    again = wait_final(run_id, after_run_count=first.run_count)
    after_retry = request_count(extraction_endpoint)
    assert again.id == run_id and again.state.type.value == "COMPLETED", served.output()[-3000:]
    assert after_retry - after_failure == PROBES_PER_RUN + len(failing_samples) == 9

    manifest = read_manifest(store)
    assert manifest["sample_id"].to_pylist() == ids  # every sample once, in shard order
    assert verify(store).ok
    shard_states = {}
    for t in task_runs(run_id):
        if t.name.startswith("extract-"):
            shard_states.setdefault(t.name.removeprefix("extract-"), []).append(t.state.name)
    # first attempt: 3 completed, 2 failed; retry: the 3 come from the cache, the 2 run again
    for shard in ("000000", "000002", "000004"):
        assert sorted(shard_states[shard]) == ["Cached", "Completed"], shard_states
    for shard in FAILING:
        assert sorted(shard_states[shard]) == ["Completed", "Failed"], shard_states
    ran_on = [row["ran on"] for row in shard_table_rows(f"{name}-shards", run_id).values()]
    # cached shards keep where their first run put them; the retried two ran in the retry
    want = "tcp://" if runner == "dask" else "flow process"
    assert len(ran_on) == 5 and all(where.startswith(want) for where in ran_on), ran_on
    print(
        f"vLLM requests: first run {after_failure - before}, retry {after_retry - after_failure} "
        f"({len(failing_samples)} samples of shards {', '.join(FAILING)} + {PROBES_PER_RUN} probe)"
    )
