"""The recipes shipped with draftflow: list them, find one by name, fork one."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from draftflow.recipe.load import RecipeError, read_yaml

RECIPE_SUFFIXES = (".yaml", ".yml")


def shipped_dir() -> Path:
    """`recipes/` of the source tree, or the copy packed into an installed wheel."""
    packed = resources.files("draftflow") / "_shipped_recipes"
    if packed.is_dir():
        return Path(str(packed))
    return Path(__file__).resolve().parents[2] / "recipes"


def all_recipe_files(root: Path | None = None) -> list[Path]:
    """Every YAML under the folder, recursively (forks are often kept in sub-folders)."""
    root = root or shipped_dir()
    return sorted(p for p in root.rglob("*") if p.suffix in RECIPE_SUFFIXES and p.is_file())


def describe(path: Path) -> str:
    try:
        return str(read_yaml(path).get("description", ""))
    except RecipeError as err:
        return f"(invalid: {err})"


def resolve(name_or_path: str) -> Path:
    """A path to an existing file, or the name of a shipped recipe (with or without .yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in all_recipe_files():
        if name_or_path in (candidate.stem, candidate.name):
            return candidate
    raise RecipeError(f"{name_or_path}: no such recipe file or shipped recipe (see `draftflow recipes ls`)")


def fork(name_or_path: str, dest: str | Path, overwrite: bool = False) -> Path:
    """Copy a recipe verbatim (comments included) so the fork keeps its launch notes."""
    src = resolve(name_or_path)
    dest = Path(dest)
    if dest.exists() and not overwrite:
        raise RecipeError(f"{dest}: already exists (pass --force to overwrite)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    return dest
