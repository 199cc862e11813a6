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


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _local_identity(path_str: str) -> dict | None:
    """Content of a local path: file digest, or for a folder its small files' digests and weight sizes."""
    path = Path(expand(path_str))
    if path.is_file():
        return {"sha256": _file_digest(path)}
    if not path.is_dir():
        return None
    out: dict[str, str | int] = {}
    for child in sorted(path.iterdir()):
        if child.name in _TOKENIZER_FILES or child.suffix == ".json" and child.stat().st_size < 1 << 20:
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
