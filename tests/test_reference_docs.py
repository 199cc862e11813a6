"""The generated reference pages (docs/reference/recipe.md, docs/reference/cli.md) match the
schema and the parser they come from, and `draftflow --version` shows the one version."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import draftflow
from flows.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen_reference.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_pages_are_current():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_field_missing_from_the_page_fails_the_check(tmp_path, monkeypatch, capsys):
    gen = load_generator()
    stale = tmp_path / "recipe.md"
    lines = gen.recipe_page().splitlines(keepends=True)
    stale.write_text("".join(line for line in lines if not line.startswith("| `block_size` |")))
    monkeypatch.setattr(gen, "RECIPE_PAGE", stale)
    monkeypatch.setattr(gen, "REPO", tmp_path.parent)
    assert gen.main(["--check"]) == 1
    assert "recipe.md is stale: run" in capsys.readouterr().err


def test_every_field_and_every_command_is_on_its_page():
    from draftflow.recipe.schema import Recipe, TrainingSection

    gen = load_generator()
    recipe = gen.recipe_page()
    for name in Recipe.model_fields:
        assert f"| `{name}` |" in recipe
    for name in TrainingSection.model_fields:
        assert f"| `{name}` |" in recipe
    cli = gen.cli_page()
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse has no public one)
    for name in commands:
        assert f"`draftflow {name}`" in cli
    assert {"pipeline", "demo", "blocks", "deploy", "recipes", "train"} <= set(commands)


def test_version_is_defined_once_and_shown_by_the_command(capsys):
    from importlib.metadata import version

    assert version("draftflow") == draftflow.__version__
    try:
        build_parser().parse_args(["--version"])
    except SystemExit as done:
        assert done.code == 0
    assert capsys.readouterr().out.strip() == f"draftflow {draftflow.__version__}"
