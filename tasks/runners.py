"""Where the extraction shard tasks run: the flow's thread pool, or Dask worker processes.

`prefect.task_runner: dask` (recipe) hands the shard tasks to prefect-dask's DaskTaskRunner:
a `distributed.LocalCluster` of `prefect.workers` processes started for the mapping and closed
after it, or the running scheduler at `prefect.address`. Every other task of the flow (server,
preparation, planning, shard table) stays in the flow-run process. Shard tasks keep their
cache key and persisted results, so a retried flow run skips completed shards whichever
worker ran them; a worker that dies mid-shard has its task re-run on another worker by the
Dask scheduler, and the store's commit protocol keeps the dead attempt invisible.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.task_runners import TaskRunner

from draftflow.recipe.checks import scheduler_errors
from draftflow.recipe.load import RecipeError
from draftflow.run_ref import RunRef
from tasks.infra import blocks_for, plan_for


# Never cached: whether the scheduler answers is a fact about now, not about the inputs.
@task(name="check-task-runner", cache_policy=NO_CACHE, persist_result=False)
def check_task_runner(ref: RunRef) -> dict:
    """The recipe's `prefect` section; fails (naming the field) when its Dask scheduler does not
    answer, so a dead address stops the flow before any vLLM server starts."""
    r = plan_for(ref, blocks_for(ref, vllm=False)).recipe
    errors = scheduler_errors(r)
    if errors:
        raise RecipeError("; ".join(f"{ref.recipe}: {e}" for e in errors))
    return r.prefect.model_dump() | {"workers": r.prefect.local_workers}


@contextmanager
def shard_runner(settings: dict) -> Iterator[TaskRunner]:
    """The task runner to map shard tasks on (call inside a flow): the flow's own for
    task_runner threads; a started DaskTaskRunner for dask, closed (a local cluster stopped) on exit."""
    if settings["task_runner"] != "dask":
        yield FlowRunContext.get().task_runner
        return
    from prefect_dask import DaskTaskRunner

    if settings["address"]:
        runner = DaskTaskRunner(address=settings["address"])
    else:
        # One thread per worker process: a worker runs one shard at a time, so `workers` is the
        # number of shards in flight and a killed process loses one shard, not several.
        runner = DaskTaskRunner(
            cluster_class="distributed.LocalCluster",
            cluster_kwargs={
                "n_workers": settings["workers"],
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
            },
        )
    with _api_url_for_workers(), runner:
        yield runner


def _api_url_for_workers():
    """Workers rebuild the flow's settings from the submitting context. Without PREFECT_API_URL
    (embedded mode) each worker would start a temporary server of its own and record its task
    runs there; point them at the flow's temporary server instead."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        return nullcontext()
    return temporary_settings(updates={PREFECT_API_URL: str(FlowRunContext.get().client.api_url)})


def where_this_runs() -> dict:
    """The Dask worker (address) or the flow-run process running the current task, its host and pid:
    recorded in each shard's result and the shard table."""
    try:
        from distributed import get_worker

        worker = get_worker().address
    except (ImportError, ValueError):  # not inside a Dask worker
        worker = "flow process"
    return {"worker": worker, "host": socket.gethostname(), "pid": os.getpid()}
