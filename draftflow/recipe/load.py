"""Reading recipe files: YAML → dotted overrides → :class:`Recipe`, with one-line errors.

Every error raised here is a :class:`RecipeError` whose message names the file and the
field (``recipes/x.yaml: drafter.block_size: Input should be greater than or equal to 2``),
so a user who forked a recipe sees at once what to fix.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from draftflow.recipe.redact import redact_override
from draftflow.recipe.schema import Recipe


class RecipeError(ValueError):
    """A recipe that cannot be used; the message is one line naming file and field."""


def default_home() -> Path:
    """Where draftflow keeps caches (vLLM virtualenv, converted models)."""
    return Path(os.environ.get("DRAFTFLOW_HOME", Path.home() / ".cache" / "draftflow"))


def expand(value: str) -> str:
    """Expand `${VAR}` and `~` in a path-like recipe value; DRAFTFLOW_HOME has a default."""
    env = {"DRAFTFLOW_HOME": str(default_home()), **os.environ}
    out = value
    for key in sorted(env, key=len, reverse=True):
        out = out.replace("${" + key + "}", env[key])
    if "${" in out:
        raise RecipeError(f"{value!r}: undefined environment variable in recipe value")
    return os.path.expanduser(out)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=VALUE` → (["a","b","c"], VALUE parsed as YAML so `16`, `true`, `[1,2]` work)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. drafter.block_size=16")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        # The value itself is not echoed when it may be a secret (launch env, --api-key, ...).
        raise RecipeError(
            f"--set {redact_override(item)!r}: value is not valid YAML ({err.problem})"
        ) from None
    return key.strip().split("."), value


def string_override(key: str, value: str) -> str:
    """`key=VALUE` whose value :func:`parse_override` reads back as exactly the string `value`.

    For values that come from elsewhere (a block's URL, a path): parsed as plain YAML, a `#`
    would start a comment, `no` would be a boolean and `123` a number. A JSON string is a YAML
    double-quoted scalar, read back verbatim.
    """
    return f"{key}={json.dumps(value, ensure_ascii=False)}"


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Return a copy of ``data`` with each dotted override set (validated later, like the file).
    A secret shown as ``KEY=**********`` gets its value from the environment (recipe.redact)."""
    from draftflow.recipe.redact import restore_secret_overrides

    out = copy.deepcopy(data)
    for item in restore_secret_overrides(overrides):
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"--set {item!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return out


def format_validation_error(source: str, err: ValidationError) -> str:
    """One line per problem, each `SOURCE: dotted.field: message`; joined by '; '."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (not in the schema; check the spelling)"
        elif e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        parts.append(f"{source}: {loc or '(recipe)'}: {msg}")
    return "; ".join(parts)


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise RecipeError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def recipe_from_dict(data: dict, source: str = "<recipe>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(source, err)) from None


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate one recipe file (schema checks only)."""
    return recipe_from_dict(apply_overrides(read_yaml(path), overrides), str(path))
