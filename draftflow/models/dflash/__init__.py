"""DFlash block-diffusion drafter: config, model (+ loss), attention, checkpoint fields, algorithm."""

from draftflow.models.dflash import attention, checkpoint, config, model
from draftflow.models.dflash.algorithm import DFlash
from draftflow.models.dflash.config import DFlashConfig, resolve_mask_token_id
from draftflow.models.dflash.model import DFlashDrafter, dflash_loss, sample_anchors

__all__ = [
    "DFlash",
    "DFlashConfig",
    "DFlashDrafter",
    "attention",
    "checkpoint",
    "config",
    "dflash_loss",
    "model",
    "resolve_mask_token_id",
    "sample_anchors",
]
