"""The trainer measures validation τ, writes TensorBoard and a chart, and exports the best step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftflow.paths import EXPORT_SELECTION, RunLayout
from draftflow.plan import Plan
from draftflow.sample_source import open_source
from draftflow.train import validation
from tests.train.test_trainer import TRAIN, _run

pytestmark = pytest.mark.slow


def _event_tags(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_validation_tau_is_logged_to_metrics_tensorboard_and_a_chart(train_dir):
    recipe = str(train_dir / "recipe.yaml")
    settings = [
        "--set",
        "training.validation_fraction=0.15",
        "--set",
        "training.eval_every=2",
        "--set",
        "training.epochs=2",
    ]
    metrics, result = _run(TRAIN + [recipe, "--run-id", "val"] + settings)
    validated = [m for m in metrics if "val_tau" in m]
    assert len(validated) >= 3
    # validated: every 2nd step (training.eval_every) and each epoch's last step, nothing else
    epoch_ends = {max(m["step"] for m in metrics if m["epoch"] == e) for e in {m["epoch"] for m in metrics}}
    expected = {s for s in range(1, result["steps"] + 1) if s % 2 == 0} | epoch_ends
    assert [m["step"] for m in validated] == sorted(expected)
    for m in validated:
        assert m["val_tau"] >= 1.0 and len(m["val_acc"]) == 3 and m["val_drafts"] > 0
        assert m["val_reference"] == "target"
    # validation samples are never trained on: the held-out ids are not in any training step
    plan = Plan.load(recipe, [s for s in settings if s != "--set"])
    source = open_source(plan)
    train_items, held = validation.split_items(source.items(), 0.15, 64)
    assert held and validated[0]["val_samples"] == len(held)
    run = Path(result["run_dir"])
    tags = _event_tags(run / "tensorboard")
    assert {"train/loss", "val/tau", "val/acc_1"} <= set(tags)
    assert [s for s, _ in tags["val/tau"]] == [m["step"] for m in validated]
    assert [v for _, v in tags["val/tau"]] == pytest.approx([m["val_tau"] for m in validated], rel=1e-6)
    assert (run / "training_curves.png").stat().st_size > 1000
    best = max(validated, key=lambda m: m["val_tau"])  # first of the maxima: a later tie is not better
    selection = json.loads((Path(result["export_dir"]) / EXPORT_SELECTION).read_text())
    assert selection["step"] == best["step"] == result["selected"]["step"]
    assert selection["val_tau"] == pytest.approx(best["val_tau"])


def test_the_best_validation_step_is_the_one_exported_when_a_later_one_is_worse(train_dir):
    """A constructed case on the real drafter and store: validate at init (step 1), after learning the
    validation samples (step 2: the best), after wrecking the fused-context weights (step 3: worse)."""
    from draftflow.train import drafter
    from draftflow.train.__main__ import _select
    from draftflow.train.batches import collate
    from draftflow.train.monitor import Monitor, load_best
    from draftflow.train.runtime import Runtime

    plan = Plan.load(str(train_dir / "recipe.yaml"), ["training.validation_fraction=0.1"])
    setup, source = drafter.build(plan), open_source(plan)
    layout = RunLayout(str(train_dir / "run"))
    monitor, train_items = Monitor.for_plan(
        plan, setup, source, layout, Runtime(0, 1, 0, torch.device("cpu"))
    )
    assert monitor.validation_ids and not set(monitor.validation_ids) & {sid for sid, _ in train_items}
    monitor.start(0, [])
    model = setup.model
    taus = [monitor.validate(model, 1)["val_tau"]]
    batch = collate(source.load(monitor.validation_ids), setup.layers, with_last=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for step in range(80):
        out = setup.loss_fn(model, batch, torch.Generator().manual_seed(step))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    learnt = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    taus.append(monitor.validate(model, 2)["val_tau"])
    with torch.no_grad():
        model.fc.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    record = monitor.validate(model, 3)
    taus.append(record["val_tau"])
    assert taus[1] > max(taus[0], taus[2]), taus
    assert (record["best_step"], record["best_val_tau"]) == (2, taus[1])
    monitor.close()

    selected = _select(setup, layout, 3, monitor)  # what the trainer exports: step 2's weights
    assert selected["step"] == 2 and selected["val_tau"] == taus[1] and selected["last_step"] == 3
    for name, value in learnt.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), value, msg=name)
    assert load_best(layout, drafter.build(plan).model).step == 2  # kept on disk: a rerun finds it
    assert sorted(p.name for p in Path(layout.best_dir).iterdir()) == [
        "best.json",
        "step-00000002.safetensors",
    ]


def test_max_train_samples_trains_on_that_many_samples_and_the_run_records_it(train_dir):
    recipe = str(train_dir / "recipe.yaml")
    _, full = _run(TRAIN + [recipe, "--run-id", "all", "--set", "training.validation_fraction=0.1"])
    capped = ["--set", "training.validation_fraction=0.1", "--set", "training.max_train_samples=12"]
    _, part = _run(TRAIN + [recipe, "--run-id", "part"] + capped)
    assert part["train_samples"] == 12 < full["train_samples"]
    assert part["steps"] < full["steps"]
    settings = json.loads(Path(RunLayout(part["run_dir"]).settings).read_text())
    assert settings["training"]["max_train_samples"] == 12
    assert (
        "max_train_samples"
        not in json.loads(Path(RunLayout(full["run_dir"]).settings).read_text())["training"]
    )
