"""Tasks: evaluate a checkpoint (offline + in vLLM), and publish it if it passes."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact

from draftflow.evaluation.run import evaluate_checkpoint
from draftflow.paths import RunLayout, join
from draftflow.publish import Published
from draftflow.publish import publish as publish_checkpoint
from draftflow.refresh import find_champion, segment_details
from draftflow.remote import is_remote, open_url
from draftflow.results import EvaluateResult
from draftflow.run_ref import RunRef
from tasks.infra import artifact_key, blocks_for, plan_for, run_destination


@task(name="evaluate-checkpoint")
def evaluate(ref: RunRef, checkpoint_dir: str, run_dir: str) -> EvaluateResult:
    """Contract check, offline τ, vLLM τ (+ speedup), agreement; the report becomes artifacts."""
    infra = blocks_for(ref, vllm=False)  # evaluation starts servers of its own (target + drafter)
    plan = plan_for(ref, infra)
    out = RunLayout(run_dir).eval_dir
    options = infra.storage_options or None  # no block: the environment's (as the trainer had)
    destination = run_destination(ref, plan, infra.storage_options)
    champion = find_champion(plan, destination.url, destination.storage_options) if destination else None
    if champion is not None:
        get_run_logger().info("racing the drafter in service, %s (%s)", champion.version, champion.url)
    try:
        evaluation = evaluate_checkpoint(
            checkpoint_dir, plan, out_dir=out, storage_options=options, champion=champion
        )
    finally:
        summary = _read_text(join(out, "report.md"), options)
        if summary is not None:  # disagreement raises after writing: the report still reaches the UI
            create_markdown_artifact(
                key=artifact_key(plan, "acceptance"), markdown=summary, description="acceptance report"
            )
            chart = join(out, "acceptance.png")
            create_link_artifact(
                key=artifact_key(plan, "acceptance-chart"),
                link=chart if is_remote(chart) else f"file://{chart}",
                description="per-position acceptance chart",
            )
    get_run_logger().info("τ = %.3f (gate %s)", evaluation.tau, "pass" if evaluation.passed_gate else "FAIL")
    return EvaluateResult(join(out, "report.json"), evaluation.tau, evaluation.passed_gate)


def _read_text(url: str, storage_options: dict | None) -> str | None:
    try:
        with open_url(url, "r", storage_options) as f:
            return f.read()
    except FileNotFoundError:
        return None


@task(name="publish-checkpoint")
def publish(ref: RunRef, checkpoint_dir: str, report: str) -> Published:
    """:func:`draftflow.publish.publish` to the run's destination block (else the recipe's, with the
    store's options); a refusal fails the flow. A run folder on s3:// is read with the store's options."""
    infra = blocks_for(ref, vllm=False)
    plan = plan_for(ref, infra)
    options = infra.storage_options  # the store block's, else $DRAFTFLOW_STORAGE_OPTIONS
    published = publish_checkpoint(
        checkpoint_dir,
        report,
        run_destination(ref, plan, options),
        target_info=plan.target,
        recipe=plan.recipe,
        storage_options=options,
        history=segment_details(plan, options),
    )
    if published.kept:
        get_run_logger().warning(
            "kept the drafter in service, %s: %s", published.kept, "; ".join(published.reasons)
        )
    if published.location:
        create_link_artifact(
            key=artifact_key(plan, "published"),
            link=published.location,
            description=f"published checkpoint {published.version}",
        )
    return published
