"""`draftflow recipes ls | cp | validate | show`."""

from __future__ import annotations

import argparse
import sys

import yaml

from draftflow.cli import add_overrides
from draftflow.data.segments import resolve_window
from draftflow.recipe import catalog
from draftflow.recipe.checks import resolve_context_layer_ids, validate
from draftflow.recipe.fingerprint import fingerprint
from draftflow.recipe.load import RecipeError, expand
from draftflow.recipe.redact import redacted_recipe


def register(sub: argparse._SubParsersAction) -> None:
    recipes = sub.add_parser("recipes", help="list, fork, validate and show recipes")
    rsub = recipes.add_subparsers(dest="recipes_command", required=True)

    ls = rsub.add_parser("ls", help="list the shipped recipes")
    ls.set_defaults(func=cmd_ls)

    cp = rsub.add_parser("cp", help="fork a shipped recipe (or any recipe file) to a new file")
    cp.add_argument("name")
    cp.add_argument("dest")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    cp.set_defaults(func=cmd_cp)

    val = rsub.add_parser("validate", help="validate recipe files (schema, then the target's config)")
    val.add_argument("files", nargs="+")
    add_overrides(val)
    val.set_defaults(func=cmd_validate)

    show = rsub.add_parser("show", help="print a recipe fully resolved, defaults included")
    show.add_argument("file")
    add_overrides(show)
    show.set_defaults(func=cmd_show)


def cmd_ls(args) -> int:
    root = catalog.shipped_dir()
    for path in catalog.all_recipe_files(root):
        print(f"{path.relative_to(root).with_suffix('')!s:32}  {catalog.describe(path)}")
    return 0


def cmd_cp(args) -> int:
    dest = catalog.fork(args.name, args.dest, overwrite=args.force)
    print(f"forked {args.name} -> {dest}")
    return 0


def cmd_validate(args) -> int:
    failed = 0
    for name in args.files:
        try:
            result = validate(str(catalog.resolve(name)), args.overrides)
        except RecipeError as err:
            print(f"FAIL {err}", file=sys.stderr)
            failed += 1
            continue
        if result.skipped:
            print(
                f"ok   {name}: schema valid; target config not readable here "
                f"({result.recipe.target.model}), so these checks were SKIPPED, not passed: "
                + "; ".join(result.skipped)
            )
        else:
            print(
                f"ok   {name}: schema and target checks passed "
                f"(layers {result.layer_ids} of {result.target.num_layers})"
            )
    return 1 if failed else 0


def cmd_show(args) -> int:
    result = validate(str(catalog.resolve(args.file)), args.overrides)
    recipe = result.recipe
    # launch env values and secret extra_args print as **********: terminals and CI logs are shared
    print(yaml.safe_dump(redacted_recipe(recipe), sort_keys=False), end="")
    if result.target is None:
        print("# resolved: target config not readable here; layer ids and fingerprint unknown")
        return 0
    print(f"# resolved: extraction.layer_ids = {result.layer_ids}")
    print(f"# resolved: drafter context layers = {resolve_context_layer_ids(recipe, result.target)}")
    window = None
    if recipe.data.traffic is not None:
        window = resolve_window(recipe.data.traffic, expand(recipe.extraction.store), recipe.name, None)
        print(f"# resolved: traffic window of a run starting now = {window}")
    print(f"# resolved: data fingerprint = {fingerprint(recipe, result.layer_ids, window=window)}")
    return 0
