"""Eagle3 autoregressive drafter: recipe section, config, model (+ TTT loss), attention, checkpoint
fields, algorithm.

Names are imported on first use: a recipe imports only ``section`` (no torch), the model code
(``bench/gpu.py``) only ``config`` and ``model`` (no pydantic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftflow.models.registry import lazy_getattr

if TYPE_CHECKING:
    from draftflow.models.eagle3 import algorithm, attention, checkpoint, config, model, section
    from draftflow.models.eagle3.algorithm import Eagle3
    from draftflow.models.eagle3.config import Eagle3Config
    from draftflow.models.eagle3.model import Eagle3Drafter, eagle3_loss
    from draftflow.models.eagle3.section import Eagle3Section

_NAMES = {
    "Eagle3": "algorithm",
    "Eagle3Config": "config",
    "Eagle3Drafter": "model",
    "eagle3_loss": "model",
    "Eagle3Section": "section",
}
_MODULES = ("algorithm", "attention", "checkpoint", "config", "model", "section")

__all__ = [
    "Eagle3",
    "Eagle3Config",
    "Eagle3Drafter",
    "Eagle3Section",
    "algorithm",
    "attention",
    "checkpoint",
    "config",
    "eagle3_loss",
    "model",
    "section",
]


__getattr__ = lazy_getattr(__name__, _NAMES, _MODULES)
