"""The prepared train split as extraction sees it, and the plan of which shards to (re)generate.

Shard ``k`` holds positions ``[k*S, (k+1)*S)`` of the train split in its stored order; that
order is pinned by the recipe fingerprint, so shard ids are stable across runs and machines.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from draftflow import paths
from draftflow.data.dataset import TRAIN, load_prepared
from draftflow.plan import Plan
from draftflow.store import ExpectedSample, PlannedShard, Reconciliation, Store, read_manifest, reconcile

_TRAIN_COLUMNS = ["sample_id", "input_ids", "loss_mask", "num_tokens"]


@dataclass(frozen=True)
class TrainSet:
    """Token ids and loss masks of the train split, in stored order; sample ids checked safe."""

    table: pa.Table  # sample_id, input_ids, loss_mask, num_tokens
    positions: dict[str, int]

    @classmethod
    def load(cls, store: Store) -> TrainSet:
        table = load_prepared(store.layout, TRAIN, store.storage_options, columns=_TRAIN_COLUMNS)
        ids = table["sample_id"].to_pylist()
        for sid in ids:
            # Ids become request ids, and vLLM names its staging files after request ids: a
            # crafted id must never reach a path (ValueError names it).
            paths.safe_component(sid)
        positions = {sid: i for i, sid in enumerate(ids)}
        if len(positions) != len(ids):
            raise ValueError(f"{store.layout.samples}: duplicate sample ids in the train split")
        return cls(table, positions)

    def expected(self) -> list[ExpectedSample]:
        ids, counts = self.table["sample_id"].to_pylist(), self.table["num_tokens"].to_pylist()
        return [ExpectedSample(sid, int(n)) for sid, n in zip(ids, counts, strict=True)]

    def tokens(self, sample_id: str) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask uint8) of one sample."""
        i = self.positions[sample_id]
        ids = self.table["input_ids"][i].values.to_numpy(zero_copy_only=False)
        mask = self.table["loss_mask"][i].values.to_numpy(zero_copy_only=False)
        return np.array(ids, dtype=np.int32), np.array(mask, dtype=np.uint8)


_train_sets: dict[tuple[str, str], TrainSet] = {}
_train_sets_lock = threading.Lock()


def train_set(store: Store) -> TrainSet:
    """:meth:`TrainSet.load`, cached per data folder: a worker running many shard tasks reads it once.

    Safe to cache: a complete prepared folder is never rewritten (its fingerprint names it).
    """
    key = (store.layout.root, json.dumps(store.storage_options, sort_keys=True, default=str))
    with _train_sets_lock:
        if key not in _train_sets:
            _train_sets.clear()  # one data folder at a time is the normal case: bound the memory
            _train_sets[key] = TrainSet.load(store)
        return _train_sets[key]


def _store(plan: Plan, store: Store | None) -> Store:
    return Store(plan.data) if store is None else store


def expected_samples(plan: Plan, store: Store | None = None) -> list[ExpectedSample]:
    """The train split as (sample id, token count), in the stable order shard ids are cut from."""
    return train_set(_store(plan, store)).expected()


def plan_extraction(plan: Plan, store: Store | None = None, *, verify: bool | str = True) -> Reconciliation:
    """What is present, missing, failed or corrupt, and the shards to (re)generate."""
    store = _store(plan, store)
    return reconcile(
        store, expected_samples(plan, store), plan.recipe.extraction.samples_per_shard, verify=verify
    )


def plan_shard(plan: Plan, store: Store, shard_id: str, *, verify: bool | str = True) -> PlannedShard | None:
    """The plan for one shard id, or None when it is already complete (only that shard is read)."""
    expected = expected_samples(plan, store)
    per_shard = plan.recipe.extraction.samples_per_shard
    count = math.ceil(len(expected) / per_shard)
    if not (isinstance(shard_id, str) and shard_id.isdigit() and paths.shard_id(int(shard_id)) == shard_id):
        raise ValueError(f"not a shard id: {shard_id!r} (expected e.g. {paths.shard_id(0)!r})")
    if int(shard_id) >= count:
        raise ValueError(f"shard {shard_id} does not exist: the train split has {count} shards")
    manifest = read_manifest(store)
    mine = manifest.filter(pc.equal(manifest["shard_id"], shard_id))
    # Reconciling against this shard's rows alone verifies only this shard; the other shards
    # then look missing and are planned too, which is ignored here.
    rec = reconcile(store, expected, per_shard, manifest=mine, verify=verify)
    return next((p for p in rec.to_generate if p.shard_id == shard_id), None)
