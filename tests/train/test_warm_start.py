"""A refresh's trainer parts: the warm start from an exported drafter, its own schedule, and replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from draftflow.plan import Plan
from draftflow.train import drafter
from draftflow.train.__main__ import warm_schedule
from draftflow.train.replay import replayed


def test_a_warm_start_begins_from_the_exported_weights_and_vocabulary(prepared_dir, tmp_path):
    plan = Plan.load(str(prepared_dir / "recipe.yaml"))
    served = drafter.build(plan)
    torch.manual_seed(7)
    with torch.no_grad():  # as if trained: no fresh build has these weights
        for p in served.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    folder = drafter.export(served, plan, tmp_path / "in-service")
    exported = load_file(str(folder / "model.safetensors"))

    fresh = drafter.build(plan)
    warm = drafter.build(plan, init_from=folder)
    state, fresh_state = warm.model.state_dict(), fresh.model.state_dict()
    trained = [k for k, p in served.model.named_parameters() if p.requires_grad]
    assert trained and all(torch.equal(state[k], exported[k].to(state[k].dtype)) for k in exported)
    assert not all(torch.equal(state[k], fresh_state[k]) for k in trained)
    assert torch.equal(warm.vocab.d2t, served.vocab.d2t) and torch.equal(warm.vocab.t2d, served.vocab.t2d)


def test_a_drafter_of_another_shape_is_refused_naming_the_way_out(prepared_dir, tmp_path):
    plan = Plan.load(str(prepared_dir / "recipe.yaml"))
    folder = drafter.export(drafter.build(plan), plan, tmp_path / "in-service")
    wider = Plan.load(str(prepared_dir / "recipe.yaml"), ["drafter.num_layers=2"])
    with pytest.raises(drafter.WarmStartMismatch, match="not the shape .* refresh.warm_start: false"):
        drafter.build(wider, init_from=folder)
    for size in ("1024", "null"):
        other = Plan.load(str(prepared_dir / "recipe.yaml"), [f"drafter.draft_vocab_size={size}"])
        with pytest.raises(drafter.WarmStartMismatch, match="draft vocabulary is 2048 tokens, the recipe"):
            drafter.build(other, init_from=folder)
    with pytest.raises(drafter.WarmStartMismatch, match="not a dflash export"):
        drafter.build(plan, init_from=tmp_path)


def test_a_warm_started_run_trains_for_the_refresh_epochs(prepared_dir, tmp_path):
    plan = Plan.load(str(prepared_dir / "recipe.yaml"))
    refresh = dataclasses.replace(plan, recipe=plan.recipe.model_copy(update={"refresh": None}))
    assert warm_schedule(refresh).recipe.training.epochs == plan.recipe.training.epochs
    from draftflow.recipe.refresh_section import RefreshSection

    shorter = plan.recipe.model_copy(update={"refresh": RefreshSection(epochs=3)})
    assert warm_schedule(dataclasses.replace(plan, recipe=shorter)).recipe.training.epochs == 3
    unset = plan.recipe.model_copy(update={"refresh": RefreshSection()})
    assert (
        warm_schedule(dataclasses.replace(plan, recipe=unset)).recipe.training.epochs
        == plan.recipe.training.epochs
    )


def test_replay_draws_a_seeded_fraction_that_only_grows():
    items = [(f"s{i:03d}", 10 + i) for i in range(200)]
    quarter = replayed(items, 0.25, seed=1)
    assert len(quarter) == 50 and replayed(list(reversed(items)), 0.25, seed=1) == quarter  # order-free
    half = replayed(items, 0.5, seed=1)
    assert set(quarter) <= set(half)  # a sample drawn once stays drawn as the fraction grows
    assert replayed(items, 0.25, seed=2) != quarter
    assert replayed(items, 0.0, seed=1) == [] and len(replayed(items[:3], 0.01, seed=1)) == 1
