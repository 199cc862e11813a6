"""`pipeline`: every stage of a recipe, in order, as one Prefect flow (wiring only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefect import flow

from tasks.recipe import resolve_plan


@dataclass
class PipelineResult:
    recipe: str
    fingerprint: str
    stages: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return "\n".join([f"pipeline finished: {self.recipe} (data fingerprint {self.fingerprint})",
                          f"stages run: {', '.join(self.stages)}", *self.lines])


@flow(name="draftflow-pipeline", log_prints=True)
def pipeline(recipe: str, overrides: list[str] | None = None) -> PipelineResult:
    plan = resolve_plan(recipe, overrides or [])
    result = PipelineResult(recipe=plan["name"], fingerprint=plan["fingerprint"], stages=["resolve"])
    result.lines.append(plan["description"])
    return result
