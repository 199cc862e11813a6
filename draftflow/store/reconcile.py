"""Compare the prepared sample list with the manifest and plan which shards to (re)generate.

Shard ids are stable: shard ``k`` (id :func:`draftflow.paths.shard_id`) holds the samples at
positions ``[k*S, (k+1)*S)`` of the expected list, ``S = samples_per_shard``. The expected list
comes from the prepared dataset in its stored order, which the recipe fingerprint pins, so
the same sample always lands in the same shard, on every run and every machine.

Each expected sample is exactly one of:

* ``present`` — in its shard's winning fragment, status ok, token count as expected, and the
  shard verified (when ``verify=True``);
* ``failed`` — its shard's winning fragment records an extraction failure (with the reason);
* ``corrupt`` — its shard's object is missing, has the wrong size or checksum, or the row's
  token count disagrees with the prepared data;
* ``missing`` — no fragment of its shard lists it.

A shard is complete only when all its samples are present. Every other shard is planned
for regeneration as a whole (shards are immutable) with ``attempt`` one above the attempt
that currently wins for its id, so the new commit supersedes the incomplete one.

So one data folder holds one ``S``: shards cut with another would supersede each other's
commits and lose samples. ``S`` is in the recipe fingerprint, which names the folder;
:func:`cut_with` tells whether a folder's shards are cut with a given ``S``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa

from draftflow import paths
from draftflow.store.backend import Store
from draftflow.store.manifest import STATUS_OK, read_manifest
from draftflow.store.reader import verify as verify_shards


@dataclass(frozen=True)
class ExpectedSample:
    """One sample of the prepared dataset, as reconcile needs it."""

    sample_id: str
    num_tokens: int


@dataclass(frozen=True)
class PlannedShard:
    """A shard to (re)generate: its id, its slice of the expected list and why."""

    shard_id: str
    index: int
    start: int  # positions [start, stop) of the expected list
    stop: int
    sample_ids: tuple[str, ...]
    attempt: int  # pass to write_shard(..., attempt=...)
    reasons: tuple[str, ...]  # e.g. ("2 missing", "corrupt: sha256 mismatch")


@dataclass(frozen=True)
class Reconciliation:
    """Where every expected sample stands, and the shards left to write."""

    present: tuple[str, ...]
    missing: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]  # (sample_id, reason)
    corrupt: tuple[str, ...]
    unexpected: tuple[str, ...]  # listed in the manifest but not in the expected list
    complete_shards: tuple[str, ...]
    to_generate: tuple[PlannedShard, ...]

    @property
    def done(self) -> bool:
        return not self.to_generate


def reconcile(
    store: Store,
    expected: Sequence[ExpectedSample],
    samples_per_shard: int,
    *,
    manifest: pa.Table | None = None,
    verify: bool | Literal["cached"] = True,
) -> Reconciliation:
    """Classify each expected sample and plan the incomplete shards (see module docstring).

    ``verify=True`` re-hashes every listed shard (reads them all); with ``False`` only the
    objects' presence and sizes are checked (one listing); ``"cached"`` hashes only objects
    not verified before in their current form (:mod:`draftflow.store.verify_cache`).
    """
    if samples_per_shard < 1:
        raise ValueError("samples_per_shard must be >= 1")
    ids = [e.sample_id for e in expected]
    if len(set(ids)) != len(ids):
        raise ValueError("expected samples have duplicate ids")
    manifest = read_manifest(store) if manifest is None else manifest
    rows = {(r["shard_id"], r["sample_id"]): r for r in manifest.to_pylist()}
    attempts = {r["shard_id"]: r["attempt"] for r in rows.values()}
    bad = _bad_shards(store, manifest, verify)

    present: list[str] = []
    missing: list[str] = []
    corrupt: list[str] = []
    failed: list[tuple[str, str]] = []
    complete: list[str] = []
    plans: list[PlannedShard] = []
    for k, start in enumerate(range(0, len(expected), samples_per_shard)):
        block = expected[start : start + samples_per_shard]
        shard_id = paths.shard_id(k)
        reasons = []
        counts = {"missing": 0, "failed": 0, "token count mismatch": 0}
        for sample in block:
            row = rows.get((shard_id, sample.sample_id))
            if row is None:
                missing.append(sample.sample_id)
                counts["missing"] += 1
            elif shard_id in bad:
                corrupt.append(sample.sample_id)
            elif row["status"] != STATUS_OK:
                failed.append((sample.sample_id, row["failure_reason"] or "unknown"))
                counts["failed"] += 1
            elif row["num_tokens"] != sample.num_tokens:
                corrupt.append(sample.sample_id)
                counts["token count mismatch"] += 1
            else:
                present.append(sample.sample_id)
        if shard_id in bad:
            reasons.append(f"corrupt: {bad[shard_id]}")
        reasons += [f"{n} {what}" for what, n in counts.items() if n]
        if reasons:
            plans.append(
                PlannedShard(
                    shard_id,
                    k,
                    start,
                    start + len(block),
                    tuple(s.sample_id for s in block),
                    attempts.get(shard_id, 0) + 1,
                    tuple(reasons),
                )
            )
        else:
            complete.append(shard_id)

    expected_ids = set(ids)
    unexpected = sorted({sid for (_, sid) in rows if sid not in expected_ids})
    return Reconciliation(
        tuple(present),
        tuple(missing),
        tuple(failed),
        tuple(corrupt),
        tuple(unexpected),
        tuple(complete),
        tuple(plans),
    )


def cut_with(manifest: pa.Table, expected_ids: Sequence[str], samples_per_shard: int) -> bool:
    """Whether every shard the (resolved) manifest lists holds exactly the samples at its positions
    ``[k*S, (k+1)*S)`` of ``expected_ids`` (failed ones included), ``S = samples_per_shard``."""
    held: dict[str, set[str]] = {}
    for shard_id, sample_id in zip(
        manifest["shard_id"].to_pylist(), manifest["sample_id"].to_pylist(), strict=True
    ):
        held.setdefault(shard_id, set()).add(sample_id)
    for shard_id, ids in held.items():
        if not (shard_id.isdigit() and paths.shard_id(int(shard_id)) == shard_id):
            return False
        start = int(shard_id) * samples_per_shard
        if ids != set(expected_ids[start : start + samples_per_shard]):
            return False
    return True


def _bad_shards(store: Store, manifest: pa.Table, verify: bool | Literal["cached"]) -> dict[str, str]:
    """shard_id -> problem, for listed shards whose object is missing, truncated or (verify) corrupt."""
    if verify == "cached":
        from draftflow.store.verify_cache import bad_shards

        return bad_shards(store, manifest)
    if verify:
        return {b.shard_id: b.reason for b in verify_shards(store, manifest).bad}
    sizes = {e.url: e.size for e in store.list(store.layout.shards_dir, paths.SHARD_SUFFIX)}
    bad = {}
    shards = manifest.select(["shard_id", "shard_uri", "shard_bytes"]).group_by(
        ["shard_id", "shard_uri", "shard_bytes"]
    )
    for shard in shards.aggregate([]).to_pylist():
        size = sizes.get(store.layout.resolve_shard_key(shard["shard_uri"]))
        if size != shard["shard_bytes"]:
            bad[shard["shard_id"]] = (
                "shard object missing" if size is None else f"size {size} != manifest {shard['shard_bytes']}"
            )
    return bad
