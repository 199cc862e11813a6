"""A deployment on a short interval schedule fires by itself and its run completes (served runner)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prefect_helpers import wait_final, write_tiny_recipe

from draftflow.extraction import run_extraction
from draftflow.plan import Plan
from draftflow.store import Store, read_manifest

pytestmark = pytest.mark.slow


def scheduled_runs(deployment_name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(deployment_name)
        assert [s.schedule.interval.total_seconds() for s in deployment.schedules] == [10.0]
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        )


def test_interval_schedule_fires_and_completes(
    prefect_server, start_runner, extraction_endpoint, staging_dir, smollm2_dir: Path, tmp_path: Path
):
    recipe = write_tiny_recipe(
        tmp_path / "recipe.yaml",
        smollm2_dir,
        str(tmp_path / "store"),
        extraction_endpoint,
        name="prefect-scheduled",
        staging=str(staging_dir),
    )
    plan = Plan.load(recipe)
    assert run_extraction(plan).ok  # the nightly case: the store is already complete
    samples = read_manifest(Store(plan.data))["sample_id"].to_pylist()

    runner = start_runner(
        [
            {
                "flow": "flows.stages:extract",
                "name": "every-10s",
                "interval_s": 10,
                "parameters": {"recipe": recipe},
            }
        ]
    )
    deadline = time.monotonic() + 60
    while not (
        runs := [r for r in scheduled_runs(runner.deployment_names[0]) if r.state.type.value != "SCHEDULED"]
    ):
        assert time.monotonic() < deadline, f"no scheduled run started in 60 s:\n{runner.output()[-3000:]}"
        time.sleep(1)
    run = wait_final(runs[0].id, timeout_s=180)
    assert run.state.type.value == "COMPLETED", runner.output()[-3000:]
    assert run.auto_scheduled  # created by the server's scheduler, not by this test
    assert read_manifest(Store(plan.data))["sample_id"].to_pylist() == samples  # nothing extracted twice
