"""Progress in Prefect: shard tasks waited on as they finish, with done/total, rate, ETA and failures."""

from __future__ import annotations

import pytest
from prefect import flow, task

from tasks.extract import wait_for_shards


@task
def shard_like(i: int) -> dict:
    if i == 2:
        raise RuntimeError("shard 2 broke")
    return {"shard": i}


@flow
def three_shards() -> list:
    return wait_for_shards(list(shard_like.map([0, 1, 2])), "progress-test-shards-progress")


@pytest.mark.slow
def test_waiting_for_shards_reports_progress_and_keeps_the_order(prefect_server):
    from prefect.client.orchestration import get_client

    outcomes = three_shards()
    assert outcomes[:2] == [{"shard": 0}, {"shard": 1}] and isinstance(outcomes[2], BaseException)
    with get_client(sync_client=True) as client:
        arts = [a for a in client.read_artifacts(limit=50) if a.key == "progress-test-shards-progress"]
    assert arts and arts[0].type == "progress" and float(arts[0].data) == 100.0
    line = arts[0].description
    assert line.startswith("extraction: 3/3 shards (100.0%)") and "shards/s" in line
    assert line.endswith("1 failed")
