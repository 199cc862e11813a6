"""Drafter models (plain PyTorch), their losses, draft vocabularies and checkpoints.

Each drafter kind is one subpackage: ``section`` (its recipe section), ``algorithm`` (its
:class:`~draftflow.models.algorithm.DrafterAlgorithm` subclass, the only thing the rest of
draftflow talks to, registered with ``@drafter_kind``) and its model code (``config``,
``model``, ``attention``, ``checkpoint``). :mod:`draftflow.models.registry` finds the kinds,
here and in other distributions' ``draftflow.drafters`` entry points: adding a kind is one
folder, listed nowhere.
"""

from __future__ import annotations

from pathlib import Path

from draftflow.models.registry import UnknownDrafterKind, algorithm_class, drafter_kind, kinds

__all__ = [
    "UnknownDrafterKind",
    "algorithm_class",
    "checkpoint_info",
    "drafter_kind",
    "kinds",
    "load_drafter",
]


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
    except UnknownDrafterKind:
        raise ValueError(f"{folder}: unknown speculators_model_type {kind!r}") from None
    return {
        "kind": kind,
        "aux_layer_ids": sorted(int(i) for i in config[key]),
        "speculative_tokens": speculators.speculative_tokens(config),
        "verifier": speculators.verifier(config),
    }
