"""The stage flows; each runs alone, and `pipeline` chains them. Wiring only.

Every flow takes a recipe (a path or a shipped recipe's name), dotted overrides, and the
names of infrastructure blocks (none needed for a local run: the recipe's defaults apply).
Its first task resolves them once into the run reference (draftflow.run_ref) that every
later task takes; `pipeline` runs the stages' bodies on its own reference.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from draftflow.publish import Published
from draftflow.results import EvaluateResult, ExtractResult, PrepareResult, TrainResult
from draftflow.run_ref import RunRef
from tasks.evaluate import evaluate as evaluate_task
from tasks.evaluate import publish as publish_task
from tasks.extract import (
    check_or_start_vllm,
    extract_every_shard,
    fail_on_failed_shards,
    list_segment,
    prepare_data,
    shard_table,
    stopped_unless_kept,
)
from tasks.infra import artifact_key
from tasks.recipe import resolve_run
from tasks.runners import check_task_runner
from tasks.train import train_drafter


@flow(name="draftflow-prepare", log_prints=True)
def prepare(
    recipe: str,
    overrides: list[str] | None = None,
    store_block: str | None = None,
    vllm_block: str | None = None,
) -> PrepareResult:
    ref = resolve_run(recipe, list(overrides or []), store_block, vllm_block, segment="new")
    # Starts (and stops) a plain vLLM server itself when the target must write text.
    return prepare_data(ref)


@flow(name="draftflow-extract", log_prints=True)
def extract(
    recipe: str,
    overrides: list[str] | None = None,
    store_block: str | None = None,
    vllm_block: str | None = None,
) -> ExtractResult:
    """Server → prepare → one mapped task per shard → shard table. Fails if any shard failed."""
    ref = resolve_run(recipe, list(overrides or []), store_block, vllm_block, segment="new")
    summary, _ = extract_stage(ref, keep_server=False)
    return summary


def extract_stage(ref: RunRef, keep_server: bool):
    """The extract flow's body, also run by `pipeline`: (summary, server handle). With keep_server
    the servers stay up (online / hybrid training reads from them) for the caller to stop."""
    runner = check_task_runner(ref)  # a Dask scheduler that does not answer stops us here
    # Preparation first, on a plain server (generation at full speed), then the extraction server.
    prepare_data(ref)
    server = check_or_start_vllm(ref)
    table_key = artifact_key(ref, "shards")
    with stopped_unless_kept(server, keep_server):
        shards, outcomes, reasons = extract_every_shard(
            ref,
            table_key + "-progress",
            server,  # a launched server that dies mid-run is started again, its shards retried
            runner,
        )
        summary = shard_table(shards, outcomes, table_key, reasons)
        fail_on_failed_shards(summary)
        list_segment(ref)  # a recipe with a traffic source: this window's data is complete
    return summary, server


@flow(name="draftflow-train", log_prints=True)
def train(
    recipe: str,
    overrides: list[str] | None = None,
    store_block: str | None = None,
    vllm_block: str | None = None,
    run_id: str | None = None,
    node_rank: int = 0,
) -> TrainResult:
    """With training.nnodes > 1: one run of this flow per machine (node_rank 0..nnodes-1, node 0 on
    the rendezvous host), all with the same explicit run_id (each flow run has its own id)."""
    ref = resolve_run(recipe, list(overrides or []), store_block, vllm_block)
    if ref.nnodes > 1 and not run_id:
        raise ValueError(
            f"training.nnodes={ref.nnodes}: pass the same run_id to the train flow run of every node "
            "(each flow run has its own id, so the nodes would neither meet nor share a run folder)"
        )
    return train_drafter(ref, run_id or current_run_id(), node_rank=node_rank)


@flow(name="draftflow-evaluate", log_prints=True)
def evaluate(
    recipe: str,
    checkpoint_dir: str,
    run_dir: str,
    overrides: list[str] | None = None,
    store_block: str | None = None,
) -> EvaluateResult:
    ref = resolve_run(recipe, list(overrides or []), store_block)
    return evaluate_task(ref, checkpoint_dir, run_dir)


@flow(name="draftflow-publish", log_prints=True)
def publish(
    recipe: str,
    checkpoint_dir: str,
    report: str,
    overrides: list[str] | None = None,
    destination_block: str | None = None,
    store_block: str | None = None,
) -> Published:
    ref = resolve_run(recipe, list(overrides or []), store_block, destination_block=destination_block)
    return publish_task(ref, checkpoint_dir, report)


def current_run_id() -> str:
    """The flow run's id: a retried flow run resumes its own training checkpoints."""
    return str(flow_run.id or "local")
