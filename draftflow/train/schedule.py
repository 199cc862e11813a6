"""Learning-rate schedules: linear warm-up, then cosine, linear or constant."""

from __future__ import annotations

import math


def lr_factor(step: int, total_steps: int, warmup_ratio: float, kind: str) -> float:
    warmup = int(total_steps * warmup_ratio)
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total_steps <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
