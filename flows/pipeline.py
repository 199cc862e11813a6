"""`pipeline`: every stage of a recipe, in order, as one Prefect flow (wiring only)."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow

from flows.stages import current_run_id, extract_stage
from tasks.evaluate import evaluate as evaluate_task
from tasks.evaluate import publish as publish_task
from tasks.recipe import resolve_run
from tasks.train import train_drafter


@dataclass
class PipelineResult:
    recipe: str
    fingerprint: str
    tau: float
    passed_gate: bool
    checkpoint: str
    report: str
    published: str | None
    kept: str | None = None  # a refresh that did not beat the drafter in service: that one's version
    warm_start: str | None = None  # a refresh: the drafter training began from
    replayed_samples: int = 0  # a refresh: samples of earlier segments trained on

    def summary(self) -> str:
        kept = f" (kept the drafter in service, {self.kept})" if self.kept else ""
        return "\n".join(
            [
                f"pipeline finished: {self.recipe} (data fingerprint {self.fingerprint})",
                f"mean acceptance length τ = {self.tau:.3f} (gate {'passed' if self.passed_gate else 'FAILED'})",
                f"checkpoint: {self.checkpoint}",
                *(
                    [
                        f"refresh: warm start from {self.warm_start or '(none)'}, {self.replayed_samples} replayed"
                    ]
                    if self.warm_start or self.replayed_samples
                    else []
                ),
                f"evaluation report: {self.report}",
                f"published to: {self.published or '(not published)'}{kept}",
            ]
        )


@flow(name="draftflow-pipeline", log_prints=True)
def pipeline(
    recipe: str,
    overrides: list[str] | None = None,
    store_block: str | None = None,
    vllm_block: str | None = None,
    destination_block: str | None = None,
) -> PipelineResult:
    ref = resolve_run(
        recipe, list(overrides or []), store_block, vllm_block, destination_block, segment="new"
    )
    online = ref.mode != "offline"
    _, server = extract_stage(ref, keep_server=online)
    try:  # online and hybrid training read from vLLM: the server stays up for the trainer
        trained = train_drafter(ref, current_run_id())
    finally:
        if online:
            server.stop()  # evaluation starts its own servers (target + drafter, then target alone)
    evaluated = evaluate_task(ref, trained.export_dir, trained.run_dir)
    published = publish_task(ref, trained.export_dir, evaluated.report)
    return PipelineResult(
        ref.name,
        ref.fingerprint,
        evaluated.tau,
        evaluated.passed_gate,
        trained.export_dir,
        evaluated.report,
        published.location,
        published.kept,
        trained.init_from,
        trained.replayed_samples,
    )
