"""The recipe fingerprint: a hash of everything that changes the extracted hidden states.

It names the recipe's data folder, so editing any of these inputs (target, revision,
tokenizer or chat template, layer ids, dtype, data selection) points at a fresh folder
instead of silently reusing stale hidden states. Training hyper-parameters are left out:
a new learning rate reuses the same data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from draftflow.recipe.load import expand
from draftflow.recipe.schema import Recipe

# Bump when the stored sample format or its preparation changes meaning.
DATA_FORMAT_VERSION = 1

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")
# Recorded by whichever transformers release saved a folder (config.json,
# generation_config.json); the same weights converted by 5.24 and 5.25 differ only there, and
# a re-bootstrap must still find the data extracted before it.
_WRITER_KEYS = frozenset({"transformers_version"})


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _json_digest(path: Path) -> str:
    """Digest of a json file's content, without the keys that name the release that wrote it."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return _file_digest(path)
    blob = json.dumps(_without_writer_keys(content), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _without_writer_keys(value):
    if isinstance(value, dict):
        return {k: _without_writer_keys(v) for k, v in value.items() if k not in _WRITER_KEYS}
    if isinstance(value, list):
        return [_without_writer_keys(v) for v in value]
    return value


def _local_identity(path_str: str) -> dict | None:
    """Content of a local path: file digest, or for a folder its small files' digests and weight sizes."""
    path = Path(expand(path_str))
    if path.is_file():
        return {"sha256": _file_digest(path)}
    if not path.is_dir():
        return None
    out: dict[str, str | int] = {}
    for child in sorted(path.iterdir()):
        small_json = child.suffix == ".json" and child.stat().st_size < 1 << 20
        if small_json:
            out[child.name] = _json_digest(child)
        elif child.name in _TOKENIZER_FILES:
            out[child.name] = _file_digest(child)
        elif child.is_file():
            out[child.name] = child.stat().st_size
    return out


def fingerprint_inputs(recipe: Recipe, layer_ids: list[int]) -> dict:
    # generation_dtype only when set: unset, generation computes in the extraction dtype's
    # server dtype (below), and data folders prepared before the field existed keep their name.
    unset = {"generation_dtype"} if recipe.data.generation_dtype is None else set()
    data = recipe.data.model_dump(exclude={"regenerate_concurrency", *unset})
    for source, raw in zip(data["sources"], recipe.data.sources):
        if raw.path:
            source["content"] = _local_identity(raw.path)
    template = recipe.target.chat_template
    return {
        "format": DATA_FORMAT_VERSION,
        "target": {
            "model": recipe.target.model,
            "revision": recipe.target.revision,
            "content": _local_identity(recipe.target.model),
        },
        "chat_template": (_local_identity(template) or template) if template else None,
        "layer_ids": list(layer_ids),
        "dtype": recipe.extraction.dtype,
        "data": data,
    }


def fingerprint(recipe: Recipe, layer_ids: list[int]) -> str:
    blob = json.dumps(fingerprint_inputs(recipe, layer_ids), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
