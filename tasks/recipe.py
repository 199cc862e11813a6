"""Task: resolve and validate a recipe before anything starts."""

from __future__ import annotations

from prefect import task

from tasks.infra import artifact_key, plan_for, resolve


@task(name="resolve-recipe")
def resolve_plan(
    recipe: str,
    overrides: list[str],
    store_block: str | None = None,
    destination_block: str | None = None,
) -> dict:
    """Fail fast on a bad recipe or missing object-store credentials (before any server starts);
    return small references only."""
    infra = resolve(recipe, overrides, store_block, None)
    plan = plan_for(recipe, infra, destination_block)
    return {
        "name": plan.recipe.name,
        "fingerprint": plan.fingerprint,
        "data_root": plan.data.root,
        "mode": plan.recipe.extraction.mode,
        "nnodes": plan.recipe.training.nnodes,
        "shard_table_key": artifact_key(plan, "shards"),
        "description": plan.describe(),
    }
