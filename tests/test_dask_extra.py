"""Dask is an extra (`draftflow[dask]`): a recipe asking for it where it is missing fails before any
server starts, naming the field and the install command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from draftflow.recipe import load_recipe
from draftflow.recipe.checks import scheduler_errors

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-dflash-cpu.yaml"


@pytest.mark.parametrize("hidden", ["prefect_dask", "distributed"])
def test_dask_runner_without_the_extra_names_the_field_and_the_extra(monkeypatch, hidden):
    recipe = load_recipe(DEMO, ["prefect.task_runner=dask"])
    assert scheduler_errors(recipe) == []  # installed here: dev includes the extra
    monkeypatch.setitem(sys.modules, hidden, None)  # as if not installed: find_spec answers None
    (error,) = scheduler_errors(recipe)
    assert error.startswith("prefect.task_runner: dask needs the dask extra")
    assert hidden in error and "pip install 'draftflow[dask]'" in error


def test_thread_runner_needs_no_dask(monkeypatch):
    for name in ("prefect_dask", "distributed"):
        monkeypatch.setitem(sys.modules, name, None)
    assert scheduler_errors(load_recipe(DEMO)) == []
