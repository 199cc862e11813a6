"""Eagle3 autoregressive drafter: config, model (+ TTT loss), attention, checkpoint fields, algorithm."""

from draftflow.models.eagle3 import attention, checkpoint, config, model
from draftflow.models.eagle3.algorithm import Eagle3
from draftflow.models.eagle3.config import Eagle3Config
from draftflow.models.eagle3.model import Eagle3Drafter, eagle3_loss

__all__ = [
    "Eagle3",
    "Eagle3Config",
    "Eagle3Drafter",
    "attention",
    "checkpoint",
    "config",
    "eagle3_loss",
    "model",
]
