"""A small real shard store for trainer tests: SmolLM2 hidden states written by the real store.

The hidden states come from transformers (not vLLM) so trainer tests need no server; the
extraction tests prove that the two agree.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from draftflow.data.prepare import prepare_recipe
from draftflow.extraction import extraction_info, plan_extraction
from draftflow.extraction.samples import train_set
from draftflow.plan import Plan
from draftflow.store import Sample, Store, write_shard

RECIPE = {
    "name": "train-test",
    "target": {"model": "${DRAFTFLOW_HOME}/models/SmolLM2-135M-Instruct"},
    "data": {"sources": [{"kind": "chatterbot", "max_samples": 48}], "eval_samples": 4, "max_length": 96},
    "extraction": {"dtype": "float32", "samples_per_shard": 8},
    "vllm": {"endpoints": ["http://127.0.0.1:9"]},
    "drafter": {
        "kind": "dflash",
        "block_size": 4,
        "max_anchors": 16,
        "num_layers": 1,
        "draft_vocab_size": 2048,
    },
    "training": {
        "epochs": 1,
        "lr": 1e-3,
        "pack_length": 256,
        "device": "cpu",
        "log_every": 1,
        "warmup_ratio": 0.0,
    },
}


def write_recipe(folder: Path, **sections) -> Path:
    data = yaml.safe_load(yaml.safe_dump(RECIPE))
    for section, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    data["extraction"]["store"] = str(folder / "store")
    data["training"]["run_dir"] = str(folder / "runs")
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def transformers_hidden_states(model, token_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[T, n_layers, H] in the extraction convention (id L = last layer before the final norm)."""
    captured = {}
    last = model.model.layers[-1]
    hook = last.register_forward_hook(
        lambda m, i, o: captured.__setitem__("pre_norm", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        out = model(token_ids[None], output_hidden_states=True)
    hook.remove()
    n = model.config.num_hidden_layers
    states = [captured["pre_norm"][0] if i == n else out.hidden_states[i][0] for i in layer_ids]
    return torch.stack(states, dim=1)


def fill_store(plan: Plan, smollm2_dir: Path) -> Store:
    from transformers import AutoModelForCausalLM

    store = Store(plan.data)
    prepare_recipe(plan.recipe, plan.data)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    train = train_set(store)
    info = extraction_info(plan, "offline", "transformers")
    for shard in plan_extraction(plan, store).to_generate:
        samples = []
        for sid in shard.sample_ids:
            ids, mask = train.tokens(sid)
            ids_t = torch.from_numpy(ids).long()
            hidden = transformers_hidden_states(model, ids_t, list(plan.layer_ids))
            samples.append(Sample(sid, hidden, ids_t, torch.from_numpy(mask)))
        write_shard(store, shard.shard_id, samples, info)
    return store


@pytest.fixture(scope="session")
def train_store_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A folder holding recipe.yaml and its filled store (shared; copy it before mutating)."""
    folder = tmp_path_factory.mktemp("train-store")
    recipe = write_recipe(folder)
    fill_store(Plan.load(str(recipe)), smollm2_dir)
    return folder


@pytest.fixture
def train_dir(tmp_path, train_store_dir) -> Path:
    """A private copy of the filled store with a recipe pointing at it."""
    shutil.copytree(train_store_dir / "store", tmp_path / "store")
    write_recipe(tmp_path)
    return tmp_path


@pytest.fixture
def prepared_dir(tmp_path, smollm2_dir) -> Path:
    """The recipe with its data prepared (token counts for the draft vocabulary) and no hidden
    states: enough to build a drafter, in a fraction of the filled store's set-up."""
    plan = Plan.load(str(write_recipe(tmp_path)))
    prepare_recipe(plan.recipe, plan.data)
    return tmp_path


@pytest.fixture
def train_recipe(tmp_path, smollm2_dir) -> Path:
    """The trainer tests' recipe with an empty store: for checks that run before any training."""
    return write_recipe(tmp_path)
