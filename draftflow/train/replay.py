"""The training samples of a refresh: the newest segment's, plus a replayed share of earlier ones.

A recipe with a traffic source stores each window as a segment (:mod:`draftflow.data.segments`).
A run trains on its own segment; with ``refresh.replay`` > 0 it also draws that fraction of every
earlier listed segment's train samples (the smallest ``sha256(seed:replay:id)``: every rank draws
the same, and a sample drawn once stays drawn while the fraction grows), so a drafter refreshed on
new traffic keeps what it learnt on the old. Sample ids are content hashes and a segment never
keeps a conversation an earlier one kept, so one id names one sample across segments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence

from draftflow.data.segments import list_segments
from draftflow.paths import DataLayout
from draftflow.plan import Plan
from draftflow.sample_source import Prefetcher, SampleSource, open_source
from draftflow.store import Sample


def replayed(items: Sequence[tuple[str, int]], fraction: float, seed: int) -> list[tuple[str, int]]:
    """The ``fraction`` of ``items`` (at least one when the fraction is above 0) a refresh replays."""
    if fraction <= 0 or not items:
        return []
    count = max(1, math.floor(len(items) * fraction))
    key = lambda item: hashlib.sha256(f"{seed}:replay:{item[0]}".encode()).hexdigest()  # noqa: E731
    return sorted(items, key=key)[:count]


class ReplaySource:
    """The newest segment's :class:`SampleSource` and replayed samples of earlier segments' sources,
    behind the same ``items`` / ``load`` / ``prefetch`` / ``skipped`` the trainer uses."""

    def __init__(self, newest: SampleSource, earlier: Sequence[SampleSource], fraction: float, seed: int):
        self.newest, self.earlier = newest, list(earlier)
        self._owner: dict[str, SampleSource] = {}
        self._replayed: list[tuple[str, int]] = []
        for source in self.earlier:
            chosen = replayed(source.items(), fraction, seed)
            self._replayed += chosen
            self._owner.update((sid, source) for sid, _ in chosen)

    @property
    def replayed(self) -> list[str]:
        """The ids of the earlier segments' samples this run trains on besides the newest's."""
        return [sid for sid, _ in self._replayed]

    @property
    def skipped(self) -> dict[str, str]:
        out = dict(self.newest.skipped)
        for source in self.earlier:
            out.update((sid, why) for sid, why in source.skipped.items() if sid in self._owner)
        return out

    def items(self) -> list[tuple[str, int]]:
        skipped = self.skipped
        return self.newest.items() + [item for item in self._replayed if item[0] not in skipped]

    def load(self, sample_ids: Sequence[str]) -> list[Sample]:
        groups: dict[int, list[str]] = {}
        sources = {id(self.newest): self.newest}
        for sid in sample_ids:
            source = self._owner.get(sid, self.newest)
            sources[id(source)] = source
            groups.setdefault(id(source), []).append(sid)
        got = {s.sample_id: s for key, ids in groups.items() for s in sources[key].load(ids)}
        return [got[sid] for sid in sample_ids if sid in got]

    def prefetch(self, batches: Iterable[Sequence[str]], depth: int = 2) -> Prefetcher:
        return Prefetcher(self.load, batches, depth)


def segment_plans(plan: Plan, storage_options: dict | None = None) -> list[Plan]:
    """``plan`` for each listed segment before the run's own, oldest first."""
    out = []
    for segment in list_segments(plan.store, plan.recipe.name, storage_options):
        if segment["fingerprint"] == plan.fingerprint:
            break  # a retried run's own segment is listed already: only those before it are earlier
        layout = DataLayout.for_recipe(plan.store, plan.recipe.name, segment["fingerprint"])
        out.append(dataclasses.replace(plan, fingerprint=segment["fingerprint"], data=layout))
    return out


def open_training_source(plan: Plan, **kwargs) -> SampleSource | ReplaySource:
    """What the trainer trains on: the plan's data, plus replay of earlier segments on a refresh."""
    newest = open_source(plan, **kwargs)
    refresh = plan.recipe.refresh
    if refresh is None or refresh.replay <= 0 or plan.window is None:
        return newest
    earlier = [
        open_source(p, **{**kwargs, "mode": "offline"})
        for p in segment_plans(plan, newest.store.storage_options)
    ]
    return ReplaySource(newest, earlier, refresh.replay, plan.recipe.data.seed) if earlier else newest
