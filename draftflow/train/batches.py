"""From the global packing plan to this rank's training batches, prefetched in a thread.

Each step's packs are split over ranks (:func:`rank_share`); a rank loads only the samples
of its own packs from the sample source, so no rank reads another's share. Loading runs
one or two steps ahead in a background thread, and the time the loop waits for it is
measured (the benchmark reports it as a share of the step time).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from draftflow.models.common import PackedBatch
from draftflow.sample_source import Prefetcher
from draftflow.train.packing import Item, epoch_order, global_steps, pack, rank_share


class SampleLike(Protocol):
    sample_id: str
    hidden_states: torch.Tensor  # [T, n_extracted_layers, H]
    token_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T]


class Source(Protocol):
    def items(self) -> list[tuple[str, int]]: ...
    def load(self, sample_ids: list[str]) -> list[SampleLike]: ...


@dataclass(frozen=True)
class LayerSelection:
    """Which extracted layers feed the drafter, and which one is the verifier's last state."""

    context: tuple[int, ...]  # indices into the extracted layer axis
    last: int | None  # index of layer L, for the target-logits loss


def collate(samples: list[SampleLike], layers: LayerSelection, with_last: bool) -> PackedBatch:
    """One pack (documents end to end) → a single-row PackedBatch."""
    ids = torch.cat([s.token_ids.long() for s in samples])[None]
    mask = torch.cat([s.loss_mask.to(torch.uint8) for s in samples])[None]
    doc = torch.cat([torch.full((len(s.token_ids),), i, dtype=torch.long) for i, s in enumerate(samples)])[
        None
    ]
    hidden = torch.cat([s.hidden_states[:, list(layers.context)] for s in samples])[None]
    last = None
    if with_last:
        if layers.last is None:
            raise ValueError("the target-logits loss needs the last layer L among the extracted layers")
        last = torch.cat([s.hidden_states[:, layers.last] for s in samples])[None]
    return PackedBatch(input_ids=ids, hidden_states=hidden, loss_mask=mask, doc_ids=doc, last_hidden=last)


@dataclass
class StepPlan:
    """The whole run's steps, identical on every rank.

    Packing follows each epoch's shuffle, so epochs can differ by a step or two:
    `epoch_lengths` holds each one's count.
    """

    epoch_lengths: list[int]
    epochs: int
    seed: int
    items: list[Item]
    pack_length: int
    batch_size: int
    world_size: int

    @classmethod
    def build(
        cls,
        source_items: list[tuple[str, int]],
        *,
        epochs: int,
        seed: int,
        pack_length: int,
        batch_size: int,
        world_size: int,
    ) -> StepPlan:
        items = [Item(sid, n) for sid, n in source_items]
        plan = cls([], epochs, seed, items, pack_length, batch_size, world_size)
        plan.epoch_lengths = [len(plan.steps(e)) for e in range(epochs)]
        if min(plan.epoch_lengths) == 0:
            raise ValueError(
                f"not enough data for one step: {len(items)} samples pack into fewer than "
                f"batch_size x processes = {batch_size * world_size} sequences of {pack_length} tokens"
            )
        return plan

    @property
    def total_steps(self) -> int:
        return sum(self.epoch_lengths)

    def steps(self, epoch: int) -> list[list[list[Item]]]:
        packs = pack(epoch_order(self.items, self.seed, epoch), self.pack_length)
        return global_steps(packs, self.batch_size, self.world_size)


@dataclass
class RankBatch:
    epoch: int
    epoch_step: int
    packs: list[PackedBatch]
    global_index: list[int]  # each pack's index in the global step (seeds its anchors)
    tokens: int


class StepLoader:
    """Iterates (from a resume position) over this rank's batches, loading ahead in a thread."""

    def __init__(
        self,
        plan: StepPlan,
        source: Source,
        layers: LayerSelection,
        *,
        rank: int,
        world_size: int,
        with_last: bool,
        start_epoch: int = 0,
        start_step: int = 0,
        depth: int = 2,
    ):
        self.plan, self.source, self.layers = plan, source, layers
        self.rank, self.world_size, self.with_last = rank, world_size, with_last
        self.start = (start_epoch, start_step)
        self.depth = depth
        self.wait_s = 0.0

    def _steps(self) -> Iterator[tuple[int, int, list[list[Item]], list[int]]]:
        first_epoch, first_step = self.start
        for epoch in range(first_epoch, self.plan.epochs):
            for step_idx, step in enumerate(self.plan.steps(epoch)):
                if epoch == first_epoch and step_idx < first_step:
                    continue
                mine = rank_share(step, self.rank, self.world_size)
                yield epoch, step_idx, mine, list(range(self.rank, len(step), self.world_size))

    def _load(self, spec: list) -> RankBatch:
        epoch, step_idx, mine, indices = spec
        packs = [
            collate(self.source.load([i.sample_id for i in p]), self.layers, self.with_last) for p in mine
        ]
        return RankBatch(epoch, step_idx, packs, indices, sum(i.num_tokens for p in mine for i in p))

    def __iter__(self) -> Iterator[RankBatch]:
        prefetcher = Prefetcher(self._load, self._steps(), depth=self.depth)
        counted = 0.0
        for batch in prefetcher:
            self.wait_s += prefetcher.wait_s - counted
            counted = prefetcher.wait_s
            yield batch
