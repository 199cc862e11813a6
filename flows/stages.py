"""The stage flows; each runs alone, and `pipeline` chains them. Wiring only.

Every flow takes a recipe (a path or a shipped recipe's name), dotted overrides, and the
names of infrastructure blocks (none needed for a local run: the recipe's defaults apply).
"""

from __future__ import annotations

from prefect import flow, unmapped
from prefect.runtime import flow_run

from tasks.evaluate import evaluate as evaluate_task
from tasks.evaluate import publish as publish_task
from tasks.extract import check_or_start_vllm, extract_shard, plan_shards, prepare_data, shard_table
from tasks.recipe import resolve_plan
from tasks.train import train_drafter


@flow(name="draftflow-prepare", log_prints=True)
def prepare(recipe: str, overrides: list[str] | None = None, store_block: str | None = None,
            vllm_block: str | None = None) -> dict:
    overrides = list(overrides or [])
    resolve_plan(recipe, overrides)
    # Starts (and stops) a plain vLLM server itself when the target must write text.
    return prepare_data(recipe, overrides, store_block, vllm_block)


@flow(name="draftflow-extract", log_prints=True)
def extract(recipe: str, overrides: list[str] | None = None, store_block: str | None = None,
            vllm_block: str | None = None, keep_server: bool = False):
    """Server → prepare → one mapped task per shard → shard table. Fails if any shard failed.

    With keep_server, returns (summary, server handle) so the caller can keep vLLM up
    (online / hybrid training) and stop it later.
    """
    overrides = list(overrides or [])
    ref = resolve_plan(recipe, overrides)
    # Preparation first, on a plain server (generation at full speed), then the extraction server.
    prepare_data(recipe, overrides, store_block, vllm_block)
    server = check_or_start_vllm(recipe, overrides, store_block, vllm_block)
    try:
        shards = plan_shards(recipe, overrides, store_block)["all"]
        args = (unmapped(recipe), unmapped(overrides), unmapped(ref["fingerprint"]))
        infra = (unmapped(store_block), unmapped(vllm_block))
        outcomes = [f.result(raise_on_failure=False) for f in extract_shard.map(*args, shards, *infra)]
        # The manifest is the truth: a shard it still lacks although its task "succeeded" came
        # from a stale cache (store wiped or moved) and runs again, ignoring the cache.
        missing = set(plan_shards(recipe, overrides, store_block)["missing"])
        stale = [s for s, o in zip(shards, outcomes) if s in missing and not isinstance(o, BaseException)]
        if stale:
            again = extract_shard.with_options(refresh_cache=True).map(*args, stale, *infra)
            redo = dict(zip(stale, (f.result(raise_on_failure=False) for f in again)))
            outcomes = [redo.get(s, o) for s, o in zip(shards, outcomes)]
        summary = shard_table(shards, outcomes, ref["shard_table_key"])
    except BaseException:
        server.stop()
        raise
    if not keep_server:
        server.stop()
    if summary["failed"]:
        server.stop()
        raise RuntimeError(f"{summary['failed']} of {summary['shards']} shards failed; retry the flow run "
                           "to extract only those (completed shards are cached and in the manifest)")
    return (summary, server) if keep_server else summary


@flow(name="draftflow-train", log_prints=True)
def train(recipe: str, overrides: list[str] | None = None, store_block: str | None = None,
          vllm_block: str | None = None, run_id: str | None = None) -> dict:
    overrides = list(overrides or [])
    resolve_plan(recipe, overrides)
    return train_drafter(recipe, overrides, run_id or current_run_id(), store_block=store_block,
                         vllm_block=vllm_block)


@flow(name="draftflow-evaluate", log_prints=True)
def evaluate(recipe: str, checkpoint_dir: str, run_dir: str, overrides: list[str] | None = None,
             store_block: str | None = None) -> dict:
    overrides = list(overrides or [])
    resolve_plan(recipe, overrides)
    return evaluate_task(recipe, overrides, checkpoint_dir, run_dir, store_block)


@flow(name="draftflow-publish", log_prints=True)
def publish(recipe: str, checkpoint_dir: str, report: str, overrides: list[str] | None = None,
            destination_block: str | None = None) -> dict:
    overrides = list(overrides or [])
    resolve_plan(recipe, overrides)
    return publish_task(recipe, overrides, checkpoint_dir, report, destination_block)


def current_run_id() -> str:
    """The flow run's id: a retried flow run resumes its own training checkpoints."""
    return str(flow_run.id or "local")
