"""Tasks: evaluate a checkpoint (offline + in vLLM), and publish it if it passes."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact

from blocks.infrastructure import CheckpointDestination
from draftflow.evaluation.run import evaluate_checkpoint
from draftflow.paths import RunLayout
from draftflow.publish import Destination
from draftflow.publish import publish as publish_checkpoint
from tasks import infra as infra_mod
from tasks.infra import artifact_key


@task(name="evaluate-checkpoint")
def evaluate(
    recipe: str, overrides: list[str], checkpoint_dir: str, run_dir: str, store_block: str | None = None
) -> dict:
    """Contract check, offline τ, vLLM τ (+ speedup), agreement; the report becomes artifacts."""
    infra = infra_mod.resolve(recipe, overrides, store_block, None)
    plan = infra_mod.plan_for(recipe, infra)
    out = RunLayout(run_dir).eval_dir
    try:
        evaluation = evaluate_checkpoint(
            checkpoint_dir, plan, out_dir=out, storage_options=infra.storage_options
        )
    finally:
        summary = Path(out) / "report.md"
        if summary.exists():  # disagreement raises after writing: the report still reaches the UI
            create_markdown_artifact(
                key=artifact_key(plan, "acceptance"),
                markdown=summary.read_text(),
                description="acceptance report",
            )
            create_link_artifact(
                key=artifact_key(plan, "acceptance-chart"),
                link=f"file://{Path(out) / 'acceptance.png'}",
                description="per-position acceptance chart",
            )
    get_run_logger().info("τ = %.3f (gate %s)", evaluation.tau, "pass" if evaluation.passed_gate else "FAIL")
    return {
        "report": str(Path(out) / "report.json"),
        "tau": evaluation.tau,
        "passed_gate": evaluation.passed_gate,
    }


@task(name="publish-checkpoint")
def publish(
    recipe: str, overrides: list[str], checkpoint_dir: str, report: str, destination_block: str | None = None
) -> dict:
    """:func:`draftflow.publish.publish` to the block's destination (else the recipe's); a refusal
    fails the flow."""
    plan = infra_mod.plan_for(recipe, infra_mod.Infra(overrides=list(overrides)))
    url = plan.recipe.publish.destination
    destination = (
        CheckpointDestination.load(destination_block).destination()
        if destination_block
        else Destination.parse(url)
        if url
        else None
    )
    published = publish_checkpoint(
        checkpoint_dir, report, destination, target_info=plan.target, recipe=plan.recipe
    )
    if published.location:
        create_link_artifact(
            key=artifact_key(plan, "published"),
            link=published.location,
            description=f"published checkpoint {published.version}",
        )
    return published.as_dict()
