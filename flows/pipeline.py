"""`pipeline`: every stage of a recipe, in order, as one Prefect flow (wiring only)."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow

from flows.stages import current_run_id, extract
from tasks.evaluate import evaluate as evaluate_task
from tasks.evaluate import publish as publish_task
from tasks.recipe import resolve_plan
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

    def summary(self) -> str:
        return "\n".join(
            [
                f"pipeline finished: {self.recipe} (data fingerprint {self.fingerprint})",
                f"mean acceptance length τ = {self.tau:.3f} (gate {'passed' if self.passed_gate else 'FAILED'})",
                f"checkpoint: {self.checkpoint}",
                f"evaluation report: {self.report}",
                f"published to: {self.published or '(not published)'}",
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
    overrides = list(overrides or [])
    ref = resolve_plan(recipe, overrides, store_block, destination_block)
    online = ref["mode"] != "offline"
    extracted = extract(recipe, overrides, store_block, vllm_block, keep_server=online)
    server = extracted[1] if online else None
    try:  # online and hybrid training read from vLLM: the server stays up for the trainer
        trained = train_drafter(
            recipe, overrides, current_run_id(), store_block=store_block, vllm_block=vllm_block
        )
    finally:
        if server is not None:
            server.stop()  # evaluation starts its own servers (target + drafter, then target alone)
    evaluated = evaluate_task(recipe, overrides, trained["export_dir"], trained["run_dir"], store_block)
    published = publish_task(
        recipe, overrides, trained["export_dir"], evaluated["report"], destination_block, store_block
    )
    return PipelineResult(
        ref["name"],
        ref["fingerprint"],
        evaluated["tau"],
        evaluated["passed_gate"],
        trained["export_dir"],
        evaluated["report"],
        published["location"],
    )
