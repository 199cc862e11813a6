"""Task: resolve and validate a recipe once, before anything starts; the run reference."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, RUN_ID

from draftflow.run_ref import RunRef
from tasks.infra import start_run


# Cached for the flow run: a flow run retried from the UI gets the reference it started with, so
# its tasks plan the same data folder even if the recipe file was edited in between.
@task(name="resolve-recipe", cache_policy=INPUTS + RUN_ID, persist_result=True)
def resolve_run(
    recipe: str,
    overrides: list[str],
    store_block: str | None = None,
    vllm_block: str | None = None,
    destination_block: str | None = None,
    segment: str = "newest",
) -> RunRef:
    """Fail fast on a bad recipe or missing object-store credentials (before any server starts);
    the run reference every later task of the flow run takes (draftflow.run_ref). ``segment``: a
    recipe with a traffic source reads a ``new`` window (prepare, extract, pipeline) or the
    ``newest`` listed one (train, evaluate, publish)."""
    ref, plan = start_run(recipe, overrides, store_block, vllm_block, destination_block, segment)
    get_run_logger().info("%s; fingerprint %s", plan.describe(), ref.fingerprint)
    return ref
