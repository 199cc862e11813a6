"""Tasks of the extraction stage: server, preparation, shard plan, one task per shard.

Shard tasks persist their results and are cached on recipe fingerprint + store location +
shard id + the shard format version (not on the task's source, not on inputs alone). A flow
run retried from the UI re-runs the whole flow: completed shards come from the cache, failed
ones run again. The manifest stays the truth: a shard task first checks it, so a shard that
is in the manifest is never regenerated even if the cache is gone. Shard tasks run on the
runner the recipe's `prefect` section names (tasks/runners.py: the flow's threads, or Dask worker
processes); cache key, persisted results and the manifest check are the same on both.
"""

from __future__ import annotations

import hashlib
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger, task, unmapped
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE, CacheKeyFnPolicy

from draftflow.data.dataset import read_report
from draftflow.data.segments import list_segment as list_segment_core
from draftflow.extraction import expected_samples, extract_shard_by_id, plan_extraction
from draftflow.extraction.run import prepare_data as prepare_data_core
from draftflow.extraction.shards import staging_folders, sweep_staging
from draftflow.paths import shard_id
from draftflow.plan import NOT_THE_STORE
from draftflow.progress import LineSink, Progress, reporting
from draftflow.results import ExtractResult, PrepareResult
from draftflow.run_ref import RunRef
from draftflow.store import Store
from draftflow.store.fp8 import server_dtype
from draftflow.store.shard import FORMAT_VERSION
from draftflow.vllm.server import MAX_RESTARTS, ServerHandle, ensure_running, server_went_away
from tasks.infra import artifact_key, blocks_for, plan_for
from tasks.progress import prefect_sinks
from tasks.runners import shard_runner, where_this_runs

EXTRACTION_TAG = "draftflow-vllm-extraction"

# check-or-start-vllm's handles by a random name. A shard task gets the name, never the handle: the
# handle holds the server processes and the API key, and a task parameter may be pickled (a
# distributed task runner) or shown. Entries go with their handle.
_HANDLES: weakref.WeakValueDictionary[str, ServerHandle] = weakref.WeakValueDictionary()


def handle_ref(server: ServerHandle | None) -> str | None:
    if server is None:
        return None
    name = uuid.uuid4().hex
    _HANDLES[name] = server
    return name


def handle_named(name: str | None) -> ServerHandle | None:
    """The handle registered under ``name`` in this process; None elsewhere (a Dask worker).

    A module-level function on purpose: the shard task is pickled by value for Dask, and it must
    reach the weak registry by reference (a weakref dictionary cannot be pickled)."""
    return _HANDLES.get(name) if name else None


# Never cached, never persisted: a retried flow run (same run id) must check the servers again
# (the failure may have been a dead server), and the handle carries the vLLM API key.
@task(
    name="check-or-start-vllm", retries=1, retry_delay_seconds=10, cache_policy=NO_CACHE, persist_result=False
)
def check_or_start_vllm(ref: RunRef) -> ServerHandle:
    """Healthy endpoints are checked (model, extraction, layers); dead ones started if the
    recipe or block says how. The flow stops what was started here when it ends."""
    infra = blocks_for(ref)
    plan = plan_for(ref, infra)
    r = plan.recipe
    handle = ensure_running(
        infra.endpoints or r.vllm.endpoints,
        model=plan.target_model,
        layer_ids=plan.layer_ids,
        hidden_size=plan.target.hidden_size,
        api_key=infra.api_key,
        launch=infra.launch if infra.launch_from_block else r.vllm.launch,
        dtype=server_dtype(r.extraction.dtype),
        staging_dirs=staging_folders(plan),
        min_model_len=r.data.max_length + 1,
    )
    for note in handle.unverified:
        get_run_logger().warning(note)
    return handle


@task(name="prepare-data")
def prepare_data(ref: RunRef) -> PrepareResult:
    """Tokenised, split, optionally regenerated data in the fingerprinted folder (reused when there)."""
    infra = blocks_for(ref)
    plan = plan_for(ref, infra)
    # Generation (replies, self-generated prompts) runs on a plain server started here if none
    # answers: it is stopped before the extraction server starts (check-or-start-vllm).
    launch = infra.launch if infra.launch_from_block else plan.recipe.vllm.launch
    # regeneration (and prompt generation) report done/total, rate, ETA, failures to the log + an artifact
    with reporting(*prefect_sinks(artifact_key(plan, "preparation-progress"), "data preparation")):
        worked = prepare_data_core(
            plan, infra.endpoints, api_key=infra.api_key, storage_options=infra.storage_options, launch=launch
        )
    report = read_report(plan.data, infra.storage_options)
    get_run_logger().info("data in %s (%s)", plan.data.prepared_dir, "prepared now" if worked else "reused")
    return PrepareResult(plan.data.root, reused=not worked, report=report)


@task(name="plan-shards", cache_policy=NO_CACHE, persist_result=False)  # reads live manifest state
def plan_shards(ref: RunRef) -> dict:
    """Every shard id of the train split, those the manifest lacks (missing, failed, broken), and why;
    stale staging files are swept on the way.

    The manifest is the truth: a shard it lacks runs even when the cache says it completed
    (the store may have been wiped or pointed elsewhere); only shards it has may come from
    the cache. Shards are re-hashed when their objects changed since last verified (a same-size
    bit flip changes the object's mtime / LastModified), so a corrupt shard is planned again.
    """
    infra = blocks_for(ref, vllm=False)
    plan = plan_for(ref, infra)
    # Run before and after the shard tasks: staging files of clients killed mid-request go.
    if swept := sweep_staging(plan):
        get_run_logger().info("removed %d stale staging files", swept)
    store = Store(plan.data, infra.storage_options)
    n = len(expected_samples(plan, store))
    per = plan.recipe.extraction.samples_per_shard
    todo = {
        p.shard_id: "; ".join(p.reasons) for p in plan_extraction(plan, store, verify="cached").to_generate
    }
    every = [shard_id(k) for k in range((n + per - 1) // per)]
    return {"all": every, "missing": [s for s in every if s in todo], "reasons": todo}


def shard_cache_key(context, parameters: dict) -> str:
    """Fingerprint + store location + shard id + shard format version.

    The fingerprint says *what* the data is, not *where* it lives: without the location, the
    same recipe pointed at another store (a new bucket, a store block) would find every shard
    "cached" and write nothing there.
    """
    ref: RunRef = parameters["ref"]
    where = hashlib.sha256(ref.data_root.encode()).hexdigest()[:12]
    return f"draftflow-shard-{ref.fingerprint}-{where}-{parameters['shard']}-format{FORMAT_VERSION}"


@task(
    name="extract-shard",
    tags=[EXTRACTION_TAG],
    persist_result=True,
    cache_policy=CacheKeyFnPolicy(cache_key_fn=shard_cache_key),
    task_run_name="extract-{shard}",
)
def extract_shard(ref: RunRef, shard: str, server_ref: str | None = None) -> dict:
    """`server_ref`: names check-or-start-vllm's handle when this task runs in the flow's process
    (the default thread pool); a server it launched that dies mid-shard is then started again and
    the shard retried, as the CLI does. Elsewhere (a Dask worker) the name finds no handle: the
    shard fails, and the flow (extract_every_shard) starts the server again and reruns it."""
    where = where_this_runs()
    get_run_logger().info(
        "shard %s on %s (host %s, pid %s)", shard, where["worker"], where["host"], where["pid"]
    )
    infra = blocks_for(ref)
    # The flow checked every folder before it started; a shard task touches only the store.
    plan = plan_for(ref, infra, skip_storage=NOT_THE_STORE)
    with reporting(LineSink(get_run_logger().info)):  # this shard's samples: done/total, rate, ETA, failures
        result = extract_shard_by_id(
            plan,
            shard,
            infra.endpoints or plan.recipe.vllm.endpoints,
            api_key=infra.api_key,
            storage_options=infra.storage_options,
            verify="cached",
            server=handle_named(server_ref),
        )
    return {
        "shard": shard,
        "skipped": result.skipped,
        "samples_ok": result.samples_ok,
        "samples_failed": result.samples_failed,
        "tokens": result.tokens,
        "failures": [list(f) for f in result.failures][:20],
        "ran_on": where,
    }


@task(name="shard-table")
def shard_table(
    shards: list[str], outcomes: list[dict | BaseException], key: str, reasons: dict[str, str] | None = None
) -> ExtractResult:
    """The shard table artifact (done / failed / reason) and counts for the flow. `reasons`: why a
    shard had to run (from plan-shards: missing, failed, corrupt); a shard that was in the store
    but broken and has been extracted again shows as "regenerated"."""
    reasons = reasons or {}
    rows, failed = [], 0
    for shard, outcome in zip(shards, outcomes):
        if isinstance(outcome, BaseException):
            failed += 1
            rows.append(
                {
                    "shard": shard,
                    "status": "failed",
                    "samples_ok": "",
                    "reason": str(outcome)[:200],
                    "ran on": "",
                }
            )
        else:
            status = "already in store" if outcome["skipped"] else "extracted"
            why = reasons.get(shard, "")
            if not outcome["skipped"] and "corrupt" in why:
                status = "regenerated"
            reason = "; ".join([why] * bool(why) + [f"{s}: {r}" for s, r in outcome["failures"][:3]])
            rows.append(
                {
                    "shard": shard,
                    "status": status,
                    "samples_ok": outcome["samples_ok"],
                    "reason": reason,
                    "ran on": _ran_on(outcome),
                }
            )
    create_table_artifact(key=key, table=rows, description="extraction shards")
    return ExtractResult(shards=len(shards), failed=failed)


def _ran_on(outcome: dict) -> str:
    where = outcome.get("ran_on")  # absent from results cached before it was recorded
    return f"{where['worker']} (host {where['host']}, pid {where['pid']})" if where else ""


def wait_for_shards(futures: list, key: str) -> list:
    """Outcomes of the shard tasks in their order, reporting shards done/total, rate, ETA and
    failures to the flow's log and a progress artifact as they finish."""
    from prefect.futures import as_completed

    position = {id(f): i for i, f in enumerate(futures)}
    outcomes: list = [None] * len(futures)
    with Progress(
        "extraction",
        len(futures),
        unit="shards",
        sinks=prefect_sinks(key, "extraction shards"),
        interval_s=0.0,
    ) as progress:
        for future in as_completed(futures):
            outcome = future.result(raise_on_failure=False)
            outcomes[position[id(future)]] = outcome
            progress.advance(failed=int(isinstance(outcome, BaseException)))
    return outcomes


def extract_every_shard(
    ref: RunRef,
    progress_key: str,
    server: ServerHandle | None = None,
    runner_settings: dict | None = None,
) -> tuple[list[str], list[dict | BaseException], dict[str, str]]:
    """One mapped extract-shard task per shard (call it from a flow), each shard's outcome, and why
    each shard had to run (plan-shards' reasons). ``runner_settings``: the recipe's `prefect`
    section (check-task-runner); None: the flow's own task runner. `server`: the handle of
    check-or-start-vllm, which restarts a launched server that dies mid-run.

    The manifest is the truth: a shard it still lacks although its task "succeeded" came from a
    stale cache (store wiped or moved) and runs again, ignoring the cache.
    """
    planned = plan_shards(ref)
    shards = planned["all"]
    same = {"ref": ref, "server_ref": handle_ref(server)}

    def parameters(ids: list[str]) -> dict:
        return {**{k: unmapped(v) for k, v in same.items()}, "shard": ids}

    with shard_runner(runner_settings or {"task_runner": "threads"}) as runner:
        # done/total, rate, ETA and failures as the shard tasks finish
        outcomes = wait_for_shards(list(runner.map(extract_shard, parameters(shards))), progress_key)
        for _ in range(MAX_RESTARTS):
            # A shard task that met a dead server and could not restart it (one on a Dask worker:
            # the handle lives in this process) failed; restart here, then run those shards again.
            lost = [s for s, o in zip(shards, outcomes) if server_went_away(o)]
            if not lost or server is None or not server.restart_dead(server.restarts):
                break
            get_run_logger().warning("vLLM went away under %d shard tasks; running them again", len(lost))
            again = runner.map(extract_shard.with_options(refresh_cache=True), parameters(lost))
            redo = dict(zip(lost, wait_for_shards(list(again), progress_key)))
            outcomes = [redo.get(s, o) for s, o in zip(shards, outcomes)]
        missing = set(plan_shards(ref)["missing"])
        stale = [s for s, o in zip(shards, outcomes) if s in missing and not isinstance(o, BaseException)]
        if stale:
            again = runner.map(extract_shard.with_options(refresh_cache=True), parameters(stale))
            redo = dict(zip(stale, (f.result(raise_on_failure=False) for f in again)))
            outcomes = [redo.get(s, o) for s, o in zip(shards, outcomes)]
    return shards, outcomes, planned["reasons"]


def fail_on_failed_shards(summary: ExtractResult) -> None:
    if summary.failed:
        raise RuntimeError(
            f"{summary.failed} of {summary.shards} shards failed; retry the flow run "
            "to extract only those (completed shards are cached and in the manifest)"
        )


@task(name="list-segment", cache_policy=NO_CACHE)
def list_segment(ref: RunRef) -> dict | None:
    """With a traffic source: list this run's data folder as a complete segment (its window's
    `until` is where `since: last_run` starts the next run). Runs after every shard committed."""
    if ref.window is None:
        return None
    infra = blocks_for(ref)
    plan = plan_for(ref, infra)
    return list_segment_core(
        plan.store, plan.recipe.name, plan.fingerprint, plan.window, infra.storage_options
    )


@contextmanager
def stopped_unless_kept(server: ServerHandle, keep: bool) -> Iterator[ServerHandle]:
    """Stop the servers ``check-or-start-vllm`` started when the block fails, and when it ends
    unless ``keep`` (online / hybrid training goes on reading from them)."""
    try:
        yield server
    except BaseException:
        server.stop()
        raise
    if not keep:
        server.stop()
