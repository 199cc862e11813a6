"""DFlash block-diffusion drafter: recipe section, config, model (+ loss), attention, checkpoint
fields, algorithm.

Names are imported on first use: a recipe imports only ``section`` (no torch), the model code
(``bench/gpu.py``) only ``config`` and ``model`` (no pydantic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftflow.models.registry import lazy_getattr

if TYPE_CHECKING:
    from draftflow.models.dflash import algorithm, attention, checkpoint, config, model, section
    from draftflow.models.dflash.algorithm import DFlash
    from draftflow.models.dflash.config import DFlashConfig, resolve_mask_token_id
    from draftflow.models.dflash.model import DFlashDrafter, dflash_loss, sample_anchors
    from draftflow.models.dflash.section import DFlashSection

_NAMES = {
    "DFlash": "algorithm",
    "DFlashConfig": "config",
    "resolve_mask_token_id": "config",
    "DFlashDrafter": "model",
    "dflash_loss": "model",
    "sample_anchors": "model",
    "DFlashSection": "section",
}
_MODULES = ("algorithm", "attention", "checkpoint", "config", "model", "section")

__all__ = [
    "DFlash",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashSection",
    "algorithm",
    "attention",
    "checkpoint",
    "config",
    "dflash_loss",
    "model",
    "resolve_mask_token_id",
    "sample_anchors",
    "section",
]


__getattr__ = lazy_getattr(__name__, _NAMES, _MODULES)
