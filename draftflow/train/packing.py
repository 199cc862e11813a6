"""Sequence packing and the global step order, computed from token counts alone.

Packing needs only each sample's length (from the manifest), so every rank computes the
same global plan without reading any hidden states, then loads only its own share. That
is what makes N processes reproduce 1 process with the same global batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    sample_id: str
    num_tokens: int


def epoch_order(items: list[Item], seed: int, epoch: int) -> list[Item]:
    out = list(items)
    random.Random(f"{seed}:{epoch}").shuffle(out)
    return out


def pack(items: list[Item], pack_length: int) -> list[list[Item]]:
    """Greedy next-fit in the given order: deterministic, and keeps the shuffle's mixing."""
    packs: list[list[Item]] = []
    current: list[Item] = []
    used = 0
    for item in items:
        if item.num_tokens > pack_length:
            raise ValueError(
                f"sample {item.sample_id} has {item.num_tokens} tokens > pack_length {pack_length}"
            )
        if used + item.num_tokens > pack_length and current:
            packs.append(current)
            current, used = [], 0
        current.append(item)
        used += item.num_tokens
    if current:
        packs.append(current)
    return packs


def global_steps(packs: list[list[Item]], batch_size: int, world_size: int) -> list[list[list[Item]]]:
    """Group packs into steps of `batch_size * world_size`; a short tail step is dropped
    so that every rank takes part in every step (DDP would hang otherwise)."""
    per_step = batch_size * world_size
    n = len(packs) // per_step
    return [packs[i * per_step : (i + 1) * per_step] for i in range(n)]


def rank_share(step: list[list[Item]], rank: int, world_size: int) -> list[list[Item]]:
    return step[rank::world_size]
