"""The Prefect training task: progress, validation τ, the exported step and the chart as artifacts."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_train_flow_publishes_progress_validation_and_the_exported_step(train_dir, prefect_harness):
    from prefect.client.orchestration import get_client

    from flows.stages import train

    recipe = str(train_dir / "recipe.yaml")
    result = train(recipe, ["training.validation_fraction=0.15", "training.epochs=2"], run_id="task")
    assert result.selected["step"] >= 1 and result.training_curves
    with get_client(sync_client=True) as client:
        mine = [a for a in client.read_artifacts(limit=200) if a.key and a.key.startswith("train-test")]
    artifacts = {a.key: a for a in mine}
    progress = artifacts["train-test-training-progress"]
    assert progress.type == "progress" and float(progress.data) == 100.0
    assert progress.description.startswith(f"training: {result.steps}/{result.steps} steps (100.0%)")
    assert "steps/s" in progress.description and "0 failed" in progress.description
    table = artifacts["train-test-training-validation"]
    assert '"val_tau"' in table.data and '"exported": true' in table.data
    summary = artifacts["train-test-training-summary"].data
    assert f"Exported step {result.selected['step']} of {result.steps}" in summary
    assert "data:image/png;base64," in summary and "tensorboard --logdir" in summary
