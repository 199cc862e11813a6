"""A third drafter kind is one folder that no other file names: the toy kind in tests/toy_kind,
installed as a user installs one (its folder on sys.path, with the dist-info declaring its
``draftflow.drafters`` entry point), runs through the real trainer, the export with provenance,
the contract check and the offline evaluator without any of them knowing it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow import models
from draftflow.evaluation.contract import check_contract
from draftflow.evaluation.run import evaluate_checkpoint
from draftflow.models import registry, speculators
from draftflow.paths import EXPORT_CONFIG
from draftflow.plan import Plan
from draftflow.recipe.load import RecipeError, load_recipe
from draftflow.train import RESULT_PREFIX
from draftflow.train.__main__ import main as train_main

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "tests" / "toy_kind"  # the kind's package and its dist-info; the only path naming it
DEMO = REPO / "recipes" / "smollm2-135m-dflash-cpu-demo.yaml"
# Where a kind's name could leak: code, docs, recipes, configuration.
SEARCHED = (
    "draftflow",
    "flows",
    "tasks",
    "scripts",
    "docs",
    "recipes",
    "tests",
    "bench",
    "plugins",
    "blocks",
)
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".json", ".cfg", ".ini", ".sh"}


@pytest.fixture
def toy_kind(monkeypatch) -> str:
    """The toy kind's name, while its folder is on sys.path and the registry has looked again."""
    builtin = set(models.kinds())
    monkeypatch.syspath_prepend(str(TOY))
    registry.rescan()
    (kind,) = set(models.kinds()) - builtin
    yield kind
    monkeypatch.undo()
    registry.rescan()  # later tests see the built-in kinds only


@pytest.mark.slow
def test_an_installed_toy_kind_trains_exports_and_evaluates_offline(toy_kind, train_dir, capsys):
    recipe = str(train_dir / "recipe.yaml")
    overrides = [
        f"drafter={{kind: {toy_kind}}}",
        "evaluation.num_prompts=2",
        "evaluation.max_new_tokens=12",
        "evaluation.in_vllm=false",
    ]
    args = [recipe, "--run-id", "toy", "--max-steps", "4"] + sum((["--set", o] for o in overrides), [])
    assert train_main(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(RESULT_PREFIX))
    export = Path(json.loads(line[len(RESULT_PREFIX) :])["export_dir"])

    config = json.loads((export / EXPORT_CONFIG).read_text())
    key = models.algorithm_class(toy_kind).aux_layer_ids_key
    assert config["speculators_model_type"] == toy_kind and config[key] == [2, 15, 27]
    assert speculators.speculative_tokens(config) == 2
    plan = Plan.load(recipe, overrides)
    assert check_contract(export, plan.target, verifier=plan.target_model, fingerprint=plan.fingerprint) == []

    evaluation = evaluate_checkpoint(export, plan, out_dir=train_dir / "eval")
    offline = evaluation.offline
    assert offline.drafter == toy_kind and offline.draft_length == 2 and offline.num_prompts == 2
    assert offline.drafts > 0 and offline.outputs_identical == 2  # lossless whatever the toy proposes
    assert evaluation.contract_problems == []


def test_the_kind_is_known_only_while_installed(toy_kind, monkeypatch):
    recipe = load_recipe(DEMO, [f"drafter={{kind: {toy_kind}}}"])
    assert recipe.drafter.kind == toy_kind and recipe.drafter.speculative_tokens == 2
    with pytest.raises(RecipeError, match=r"drafter\.speculative_tokens: Input should be"):
        load_recipe(DEMO, [f"drafter={{kind: {toy_kind}, speculative_tokens: 0}}"])

    monkeypatch.undo()
    registry.rescan()
    with pytest.raises(RecipeError) as err:
        load_recipe(DEMO, [f"drafter={{kind: {toy_kind}}}"])
    assert str(err.value) == (
        f"{DEMO}: drafter.kind: unknown drafter kind '{toy_kind}'; known: 'dflash', 'eagle3'"
    )


def test_no_file_outside_the_kind_folder_names_the_kind(toy_kind):
    """This test too: it reads the name from the folder and never spells it."""
    roots = [REPO / folder for folder in SEARCHED] + [p for p in REPO.iterdir() if p.is_file()]
    naming = []
    for root in roots:
        for path in [root] if root.is_file() else root.rglob("*"):
            if (
                path.is_file()
                and (path.suffix in SUFFIXES or path.name in ("Makefile", "Dockerfile"))
                and "__pycache__" not in path.parts
                and TOY not in path.parents
                and toy_kind in path.read_text(errors="replace")
            ):
                naming.append(str(path.relative_to(REPO)))
    assert naming == []
