"""Tasks: evaluate a checkpoint (offline + in vLLM), and publish it if it passes."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact

from blocks.infrastructure import CheckpointDestination
from draftflow.evaluation.contract import assert_contract
from draftflow.evaluation.report import Evaluation
from draftflow.evaluation.run import evaluate_checkpoint
from draftflow.paths import RunLayout
from draftflow.publish import push_fsspec, push_hub, write_model_card
from draftflow.recipe.load import expand
from tasks import infra as infra_mod
from tasks.infra import artifact_key


@task(name="evaluate-checkpoint")
def evaluate(recipe: str, overrides: list[str], checkpoint_dir: str, run_dir: str,
             store_block: str | None = None) -> dict:
    """Contract check, offline τ, vLLM τ (+ speedup), agreement; the report becomes artifacts."""
    infra = infra_mod.resolve(recipe, overrides, store_block, None)
    plan = infra_mod.plan_for(recipe, infra)
    out = RunLayout(run_dir).eval_dir
    try:
        evaluation = evaluate_checkpoint(checkpoint_dir, plan, out_dir=out, storage_options=infra.storage_options)
    finally:
        summary = Path(out) / "report.md"
        if summary.exists():  # disagreement raises after writing: the report still reaches the UI
            create_markdown_artifact(key=artifact_key(plan, "acceptance"), markdown=summary.read_text(),
                                     description="acceptance report")
            create_link_artifact(key=artifact_key(plan, "acceptance-chart"), link=f"file://{Path(out) / 'acceptance.png'}",
                                 description="per-position acceptance chart")
    get_run_logger().info("τ = %.3f (gate %s)", evaluation.tau, "pass" if evaluation.passed_gate else "FAIL")
    return {"report": str(Path(out) / "report.json"), "tau": evaluation.tau, "passed_gate": evaluation.passed_gate}


@task(name="publish-checkpoint")
def publish(recipe: str, overrides: list[str], checkpoint_dir: str, report: str,
            destination_block: str | None = None) -> dict:
    """Refuses (fails the flow, pushes nothing) unless the contract holds and the gate passed."""
    import json

    plan = infra_mod.plan_for(recipe, infra_mod.Infra(overrides=list(overrides)))
    evaluation = Evaluation.from_dict(json.loads(Path(report).read_text()))
    assert_contract(checkpoint_dir, plan.target)
    if not evaluation.passed_gate:
        raise RuntimeError(f"gate failed: τ {evaluation.tau:.3f} < evaluation.min_acceptance_length "
                           f"{evaluation.min_acceptance_length}; nothing was pushed")
    folder = Path(checkpoint_dir)
    chart = Path(report).with_name("acceptance.png")
    if chart.exists():
        (folder / chart.name).write_bytes(chart.read_bytes())
    write_model_card(
        folder, title=f"{plan.recipe.name} drafter", verifier=plan.recipe.target.model,
        drafter_kind=plan.recipe.drafter.kind, serve_command=f"vllm serve {folder}",
        report_markdown=evaluation.markdown(), recipe_name=plan.recipe.name, fingerprint=plan.fingerprint,
        chart_file=chart.name if chart.exists() else None,
    )
    if destination_block:
        dest = CheckpointDestination.load(destination_block).settings()
    else:
        dest = {"url": plan.recipe.publish.destination, "storage_options": {}, "hf_repo_id": None, "hf_token": None}
    if dest["hf_repo_id"] or (dest["url"] or "").startswith("hf://"):
        repo = dest["hf_repo_id"] or dest["url"].removeprefix("hf://")
        published = push_hub(folder, repo, dest["hf_token"])
    elif dest["url"]:
        published = push_fsspec(folder, expand(dest["url"]), plan.recipe.name, dest["storage_options"])
    else:
        get_run_logger().info("publish.destination is not set: nothing to push")
        return {"location": None, "pushed": False}
    create_link_artifact(key=artifact_key(plan, "published"), link=published.location,
                         description=f"published checkpoint {published.version}")
    return {"location": published.location, "version": published.version, "pushed": published.pushed}
