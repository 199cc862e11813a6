"""Drafter models (plain PyTorch), their losses, draft vocabularies and checkpoints.

Each drafter is a subpackage with the same files: ``config`` (dataclass), ``model``
(architecture + loss), ``attention`` (who sees what), ``checkpoint`` (speculators-format
export/load). :data:`ALGORITHMS` maps the ``speculators_model_type`` / recipe ``kind`` to
the subpackage; :func:`load_drafter` rebuilds any exported folder.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

ALGORITHMS = ("dflash", "eagle3")


def algorithm(name: str) -> ModuleType:
    """The drafter subpackage for ``name`` ("dflash" | "eagle3")."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(ALGORITHMS)}")
    return importlib.import_module(f"draftflow.models.{name}")


def load_drafter(folder: str | Path, *, target: str | Path | None = None, **kwargs):
    """Rebuild the drafter exported in ``folder`` (DFlash or Eagle3, from its config.json)."""
    from draftflow.models.speculators import read_config

    kind = read_config(folder).get("speculators_model_type")
    return algorithm(kind).checkpoint.load(folder, target=target, **kwargs)
