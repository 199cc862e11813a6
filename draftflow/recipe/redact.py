"""What of a recipe may be written next to a checkpoint, or shown, without leaking secrets.

A recipe is meant to be shared, but two of its fields are where operators put credentials:
``vllm.launch.env`` (``HF_TOKEN``, cloud keys) and ``vllm.launch.extra_args`` (``--api-key``,
``--hf-token``). Exported folders travel far (a Hub repo), so they get these fields redacted:
every env *value* (names stay, so the recipe still says what was set) and, in extra_args, the
value of any flag whose name looks secret, or any argument that itself names a secret.
``--set`` overrides of those fields are redacted the same way in the exported command.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

REDACTED = "<redacted>"
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


def redact_override(item: str) -> str:
    """One ``--set KEY=VALUE``: the value hidden when KEY is a secret-bearing field or looks secret."""
    key, sep, _ = item.partition("=")
    dotted = key.strip()
    if sep and (dotted.startswith(_SECRET_FIELDS) or looks_secret(dotted.rsplit(".", 1)[-1])):
        return f"{key}={REDACTED}"
    return item
