"""samples_per_shard cuts the shards, so it names the data folder: edit it, run, edit it back, run
→ every sample still present. Folders named before it joined the fingerprint keep their name
while their shards are cut with the recipe's value (no re-extraction after an upgrade)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import store_synthetic as syn

from draftflow.data.prepare import prepare_recipe
from draftflow.extraction import TrainSet
from draftflow.paths import DataLayout
from draftflow.plan import Plan
from draftflow.recipe.fingerprint import fingerprint_inputs
from draftflow.store import Reconciliation, Store, reconcile, write_shard


@pytest.fixture
def recipe(tmp_path: Path, tiny_llama_dir: Path) -> str:
    path = tmp_path / "recipe.yaml"
    data = {
        "name": "layout",
        "target": {"model": str(tiny_llama_dir)},
        "data": {"sources": [{"kind": "chatterbot", "max_samples": 14}], "eval_samples": 2, "max_length": 64},
        "extraction": {"store": str(tmp_path / "store"), "samples_per_shard": 4, "layer_ids": [1, 4]},
        "drafter": {"kind": "dflash"},
    }
    path.write_text(json.dumps(data))
    return str(path)


def _run(recipe: str, per_shard: int) -> tuple[Plan, Reconciliation]:
    """What `draftflow extract` does, with synthetic hidden states: prepare, reconcile, write the
    planned shards. Returns the plan and the reconciliation found *before* writing."""
    plan = Plan.load(recipe, [f"extraction.samples_per_shard={per_shard}"])
    prepare_recipe(plan.recipe, plan.data)
    store = Store(plan.data)
    found = _extract(store, per_shard)
    return plan, found


def _extract(store: Store, per_shard: int) -> Reconciliation:
    expected = TrainSet.load(store).expected()
    tokens = {e.sample_id: e.num_tokens for e in expected}
    found = reconcile(store, expected, per_shard)
    for shard in found.to_generate:
        samples = [syn.sample(s, tokens[s]) for s in shard.sample_ids]
        write_shard(store, shard.shard_id, samples, syn.info(), attempt=shard.attempt)
    assert reconcile(store, expected, per_shard).done
    return found


def test_edit_samples_per_shard_run_edit_back_run_loses_nothing(recipe: str):
    first, _ = _run(recipe, 4)
    train = TrainSet.load(Store(first.data)).expected()
    assert len(train) >= 10  # enough for the two cuts below to disagree
    _run(recipe, 6)
    back, found = _run(recipe, 4)
    assert back.data.root == first.data.root
    assert found.done and found.missing == () and found.corrupt == (), found.to_generate
    assert found.present == tuple(e.sample_id for e in train)


def _legacy_name(plan: Plan) -> str:
    """The folder name a recipe got before samples_per_shard joined the fingerprint."""
    inputs = fingerprint_inputs(plan.recipe, list(plan.layer_ids))
    inputs.pop("samples_per_shard", None)
    blob = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_a_folder_named_before_keeps_its_name_while_its_shards_fit(recipe: str, tmp_path: Path):
    plan = Plan.load(recipe)
    legacy = DataLayout.for_recipe(str(tmp_path / "store"), plan.recipe.name, _legacy_name(plan))
    prepare_recipe(plan.recipe, legacy)
    assert Plan.load(recipe).data.root != legacy.root  # prepared, but no shards say how they are cut
    _extract(Store(legacy), 4)

    assert Plan.load(recipe).data.root == legacy.root  # its shards hold 4 samples each: reused
    other = Plan.load(recipe, ["extraction.samples_per_shard=6"])
    assert other.data.root != legacy.root
    assert Plan.load(recipe).data.root == legacy.root
