"""Task: resolve and validate a recipe before anything starts."""

from __future__ import annotations

from prefect import task

from draftflow.plan import Plan
from tasks.infra import artifact_key


@task(name="resolve-recipe")
def resolve_plan(recipe: str, overrides: list[str]) -> dict:
    """Fail fast on a bad recipe (before any server starts); return small references only."""
    plan = Plan.load(recipe, overrides)
    return {
        "name": plan.recipe.name,
        "fingerprint": plan.fingerprint,
        "data_root": plan.data.root,
        "mode": plan.recipe.extraction.mode,
        "nnodes": plan.recipe.training.nnodes,
        "shard_table_key": artifact_key(plan, "shards"),
        "description": plan.describe(),
    }
