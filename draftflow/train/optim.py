"""The trainer's optimizer, on its own so that a training step can be built without the data
pipeline the loop imports (``bench/peer_train.py`` times the step alone)."""

from __future__ import annotations

import torch


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused (one kernel per parameter instead of a dozen elementwise ops) wherever
    torch has the fused kernel: floating-point parameters on CPU or CUDA. The same update, in a
    fraction of the time at small model sizes, where the per-op overhead dominates."""
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
