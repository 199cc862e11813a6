"""What of a recipe may be shown, logged or put on a command line without leaking secrets.

Two fields of a recipe are where operators put credentials: ``vllm.launch.env`` (``HF_TOKEN``,
cloud keys) and ``vllm.launch.extra_args`` (``--api-key``, ``--hf-token``). Wherever a recipe or
its ``--set`` overrides are shown (``recipes show``, a log line, an exported folder, a Prefect
parameter) these are redacted: every env *value* (names stay, so the recipe still says what was
set) and, in extra_args, the value of any flag whose name looks secret, or any argument that
itself names a secret. A ``--set`` override is secret when it sets one of those fields, a section
that holds one (``vllm.launch={env: ...}``), or a key that looks secret.

Secret overrides cross process boundaries redacted, in their place (``KEY=**********``), with
their values in ``$DRAFTFLOW_SECRET_OVERRIDES`` (a JSON list of ``KEY=VALUE``): argv and Prefect
parameters are readable by others, a process's environment only by its owner. The receiving
side puts each value back where its placeholder stands, so the overrides apply in their order.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

REDACTED = "**********"  # as Prefect and pydantic show a SecretStr
SECRET_OVERRIDES_ENV = "DRAFTFLOW_SECRET_OVERRIDES"
# Whole words only (separated by -, _, ., = or the ends): `--hf-token` is secret, `max_tokens` is not.
_SECRET_WORD = re.compile(
    r"(?:^|[^a-z])(?:api[_-]?key|key|token|secret|passw(?:or)?d|credentials?|auth|cookie|bearer)(?:$|[^a-z])",
    re.IGNORECASE,
)
_SECRET_FIELDS = ("vllm.launch.env", "vllm.launch.extra_args")


def looks_secret(name: str) -> bool:
    return bool(_SECRET_WORD.search(name))


def redact_args(args: Sequence[str]) -> list[str]:
    """Command-line arguments with secret values replaced: `--api-key X`, `--hf-token=X`, `TOKEN=X`,
    and `--set` overrides of secret-bearing recipe fields."""
    out: list[str] = []
    hide_next = False
    for i, arg in enumerate(args):
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if i and args[i - 1] == "--set":  # draftflow's own recipe override
            out.append(redact_override(arg))
            continue
        flag, eq, _ = arg.partition("=")
        if arg.startswith("-") and looks_secret(flag):
            out.append(f"{flag}={REDACTED}" if eq else arg)
            hide_next = not eq
        elif looks_secret(arg):
            out.append(f"{flag}={REDACTED}" if eq else REDACTED)
        else:
            out.append(arg)
    return out


def redacted_recipe(recipe: Any) -> dict:
    """The validated recipe as plain data, with launch env values and secret extra_args redacted."""
    data = json.loads(recipe.model_dump_json())
    launch = (data.get("vllm") or {}).get("launch")
    if launch:
        launch["env"] = {name: REDACTED for name in launch.get("env") or {}}
        launch["extra_args"] = redact_args(launch.get("extra_args") or [])
    return data


def is_secret_override(item: str) -> bool:
    """Whether one ``--set KEY=VALUE`` may carry a secret (see the module's rule)."""
    key, sep, raw = item.partition("=")
    dotted = key.strip()
    if not sep or not dotted:
        return False
    if dotted.startswith(_SECRET_FIELDS) or looks_secret(dotted.rsplit(".", 1)[-1]):
        return True
    holds = [field[len(dotted) + 1 :] for field in _SECRET_FIELDS if field.startswith(dotted + ".")]
    if not holds:
        return False
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return True  # unreadable here, so unreadable to us too: hide it
    return any(_set_at(value, below.split(".")) for below in holds)


def _set_at(value: Any, path: list[str]) -> bool:
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return bool(value)


def redact_override(item: str) -> str:
    """One ``--set KEY=VALUE``: the value hidden when the override may carry a secret."""
    if is_secret_override(item):
        return f"{item.partition('=')[0]}={REDACTED}"
    return item


def _is_placeholder(item: str) -> bool:
    return item.partition("=")[2] == REDACTED


def split_secret_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The overrides with secret values replaced in place, and the environment that carries those
    values to a child (empty when there are none)."""
    shown, hidden = [], []
    for item in overrides:
        if is_secret_override(item) and not _is_placeholder(item):
            hidden.append(item)
        shown.append(redact_override(item))
    return shown, ({SECRET_OVERRIDES_ENV: json.dumps(hidden)} if hidden else {})


def restore_secret_overrides(overrides: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Each ``KEY=**********`` replaced by the next value given for KEY in $DRAFTFLOW_SECRET_OVERRIDES;
    a placeholder without one is an error naming the key (never applied as the literal stars)."""
    from draftflow.recipe.load import RecipeError

    if not any(_is_placeholder(item) for item in overrides):
        return list(overrides)
    raw = (os.environ if environ is None else environ).get(SECRET_OVERRIDES_ENV, "")
    try:
        supplied = json.loads(raw) if raw.strip() else []
    except json.JSONDecodeError:
        supplied = None
    if not isinstance(supplied, list) or not all(isinstance(s, str) for s in supplied):
        raise RecipeError(f"${SECRET_OVERRIDES_ENV} must be a JSON list of KEY=VALUE strings")
    out = []
    for item in overrides:
        key = item.partition("=")[0].strip()
        if _is_placeholder(item):
            given = next((s for s in supplied if s.partition("=")[0].strip() == key), None)
            if given is None:
                raise RecipeError(
                    f"--set {key}={REDACTED}: a redacted secret whose value was not supplied "
                    f"(expected a {key}=VALUE entry in ${SECRET_OVERRIDES_ENV})"
                )
            supplied.remove(given)
            item = given
        out.append(item)
    return out
