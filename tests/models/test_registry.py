"""The drafter kinds are found, not listed; each side imports only its half of a kind (a recipe the
sections, the model code the modules), and a kind's pieces must agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import nn

from draftflow import models
from draftflow.models import registry
from draftflow.models.algorithm import DrafterAlgorithm
from draftflow.models.dflash import DFlash, DFlashSection
from draftflow.recipe.section import DrafterSection

REPO = Path(__file__).resolve().parents[2]


def _fresh_python(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_built_in_kinds_are_found_by_their_folders():
    assert models.kinds() == ["dflash", "eagle3"]
    assert registry.sections()["dflash"] is DFlashSection
    assert models.algorithm_class("dflash") is DFlash and DFlash.kind == "dflash"
    with pytest.raises(models.UnknownDrafterKind, match=r"'medusa'; known: 'dflash', 'eagle3'"):
        models.algorithm_class("medusa")


def test_a_recipe_imports_the_sections_but_no_model_code():
    _fresh_python(
        "import sys\n"
        "from draftflow.recipe import load_recipe\n"
        "for kind in ('dflash', 'eagle3'):\n"
        "    load_recipe('recipes/smollm2-135m-dflash-cpu-demo.yaml', ['drafter={kind: %s}' % kind])\n"
        "kinds = [m for m in sys.modules if m.startswith('draftflow.models.')]\n"
        "heavy = [m for m in kinds if m.endswith(('.algorithm', '.model'))] + ['torch'] * ('torch' in sys.modules)\n"
        "assert not heavy, heavy\n"
    )


def test_the_model_code_imports_no_pydantic():
    _fresh_python(
        "import sys\n"
        "from draftflow.models.dflash import DFlashConfig, DFlashDrafter, dflash_loss\n"
        "from draftflow.models.eagle3 import Eagle3Drafter, eagle3_loss\n"
        "assert 'pydantic' not in sys.modules and 'draftflow.recipe' not in sys.modules\n"
    )


def test_a_section_names_one_kind_and_declares_the_shared_fields():
    with pytest.raises(TypeError, match=r'kind: Literal\["name"\]'):

        class Untagged(DrafterSection):
            kind: str
            context_layer_ids: list[int] | None = None
            draft_vocab_size: int | None = None

    with pytest.raises(TypeError, match="declares draft_vocab_size"):

        class Partial(DrafterSection):
            kind: Literal["partial"]
            context_layer_ids: list[int] | None = None


def test_the_decorator_refuses_a_class_whose_kind_differs_from_its_section():
    with pytest.raises(TypeError, match=r"kind is 'eagle3' but its section names 'dflash'"):

        @registry.drafter_kind(section=DFlashSection)
        class Mislabelled(DrafterAlgorithm):
            kind = "eagle3"


class _Heads(DrafterAlgorithm):
    """A kind whose model has no `fc`: only what DrafterAlgorithm itself needs."""

    aux_layer_ids_key = "aux"
    architecture = "Heads"
    kind = "heads"
    build = model_from_config = loss = propose = config_fields = None


def test_export_dtype_comes_from_the_trained_weights_whatever_the_model_holds():
    model = nn.Module()
    model.frozen = nn.Embedding(4, 2).requires_grad_(False)
    model.heads = nn.Linear(2, 3).to(torch.bfloat16)
    assert _Heads(model, speculative_tokens=1).export_dtype() == torch.bfloat16
