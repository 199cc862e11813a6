"""Drafter models (plain PyTorch), their losses, draft vocabularies and checkpoints.

Each drafter kind is a subpackage (``config``, ``model``, ``attention``, ``checkpoint``,
``algorithm``) whose :class:`~draftflow.models.algorithm.DrafterAlgorithm` subclass is the
only thing the rest of draftflow talks to. :data:`ALGORITHMS` maps the recipe's
``drafter.kind`` (= ``speculators_model_type``) to that class: adding a kind is one folder
plus one line here (and its recipe section in ``draftflow/recipe/schema.py``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

ALGORITHMS: dict[str, str] = {
    "dflash": "draftflow.models.dflash.algorithm:DFlash",
    "eagle3": "draftflow.models.eagle3.algorithm:Eagle3",
}
_REGISTERED: dict[str, type] = {}


def register(cls: type, section: type | None = None) -> None:
    """Add a drafter kind at run time (a plugin, or a test's toy kind); ``section``: its recipe section."""
    _REGISTERED[cls.kind] = cls
    if section is not None:
        # lazy: the model code alone (bench/gpu.py on a bare CUDA machine) runs without pydantic
        from draftflow.recipe.schema import register_drafter_section

        register_drafter_section(section)


def unregister(kind: str) -> None:
    """Undo :func:`register` (a test's toy kind must not leak into later tests)."""
    from draftflow.recipe.schema import DRAFTER_SECTIONS, register_drafter_section

    _REGISTERED.pop(kind, None)
    if kind in DRAFTER_SECTIONS and kind not in ALGORITHMS:
        register_drafter_section(DRAFTER_SECTIONS.pop(kind), remove=True)


def kinds() -> list[str]:
    return sorted(set(ALGORITHMS) | set(_REGISTERED))


def algorithm_class(kind: str | None):
    """The :class:`~draftflow.models.algorithm.DrafterAlgorithm` subclass of ``kind``."""
    if kind in _REGISTERED:
        return _REGISTERED[kind]
    if kind not in ALGORITHMS:
        raise ValueError(f"unknown drafter kind {kind!r}; known: {', '.join(kinds())}")
    module, name = ALGORITHMS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def load_drafter(folder: str | Path, *, target: str | Path | None = None, **kwargs):
    """The drafter exported in ``folder``, of the kind its config.json names (an algorithm object)."""
    from draftflow.models.speculators import model_type, read_config  # torch: not at package import

    return algorithm_class(model_type(read_config(folder))).load(folder, target=target, **kwargs)


def checkpoint_info(folder: str | Path) -> dict:
    """kind, aux layer ids (ascending, as vLLM uses them), speculative tokens and verifier of a folder."""
    from draftflow.models import speculators  # torch: not at package import

    config = speculators.read_config(folder)
    kind = speculators.model_type(config)
    try:
        key = algorithm_class(kind).aux_layer_ids_key
    except ValueError:
        raise ValueError(f"{folder}: unknown speculators_model_type {kind!r}") from None
    return {
        "kind": kind,
        "aux_layer_ids": sorted(int(i) for i in config[key]),
        "speculative_tokens": speculators.speculative_tokens(config),
        "verifier": speculators.verifier(config),
    }
