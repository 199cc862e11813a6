"""The validation's full-vocabulary target head is held only until every validation sample's greedy
tokens are cached (it would otherwise occupy the trainer's device all run), and those tokens are the
same as the whole head's, however many rows it scores at a time."""

from __future__ import annotations

import pytest
import torch

from draftflow.models.target_weights import TargetHead
from draftflow.paths import RunLayout
from draftflow.plan import Plan
from draftflow.sample_source import open_source
from draftflow.train import drafter, monitor
from draftflow.train.monitor import Monitor
from draftflow.train.runtime import Runtime

pytestmark = pytest.mark.slow

VALIDATION = ["training.validation_fraction=0.15"]
VALIDATION_FIELDS = ("val_tau", "val_acc", "val_drafts", "val_samples", "val_reference")


def test_the_validation_head_is_freed_after_the_first_validation_and_results_do_not_change(
    train_store_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(monitor, "GREEDY_ROWS", 16)  # samples of up to 96 tokens: several chunks
    plan = Plan.load(str(train_store_dir / "recipe.yaml"), VALIDATION)
    setup = drafter.build(plan, is_main=True)
    source = open_source(plan)
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    layout = RunLayout(str(tmp_path / "run"))
    mon, _ = Monitor.for_plan(plan, setup, source, layout, runtime)
    mon._board = None
    assert mon.last_layer is not None and len(mon.validation_ids) >= 2
    mon.start(0, [])

    first = mon.validate(setup.model, 1)
    assert mon._head is None, "the head stays loaded after every validation sample's tokens are cached"
    assert sorted(mon._greedy) == sorted(mon.validation_ids)
    second = mon.validate(setup.model, 2)
    assert mon._head is None, "the second validation loaded the head again"
    assert {k: second[k] for k in VALIDATION_FIELDS} == {k: first[k] for k in VALIDATION_FIELDS}

    head = TargetHead.from_pretrained(plan.target_model, None)
    for sample in source.load(mon.validation_ids):
        whole = head(sample.hidden_states[:, mon.last_layer]).argmax(-1)
        assert torch.equal(mon._greedy[sample.sample_id], whole), sample.sample_id
