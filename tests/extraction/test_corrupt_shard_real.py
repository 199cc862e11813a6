"""A same-size bit flip in a stored shard: the trainer's hybrid mode regenerates the shard, its
offline mode names the shard and the command that repairs it (real extraction server)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch

from draftflow.extraction import run_extraction
from draftflow.plan import Plan
from draftflow.sample_source import SampleSource
from draftflow.store import CorruptShardError, Store, forget_verified, read_manifest, verify

pytestmark = pytest.mark.slow


def flip_a_bit(store: Store, shard_id: str) -> str:
    manifest = read_manifest(store)
    row = manifest.filter(pc.equal(manifest["shard_id"], shard_id)).to_pylist()[0]
    url = store.layout.resolve_shard_key(row["shard_uri"])
    blob = bytearray(Path(url).read_bytes())
    blob[-16] ^= 0x04  # inside the last sample's hidden states: same size, header intact
    with open(url, "r+b") as f:
        f.write(blob)
    return url


def shard_samples(store: Store, shard_id: str) -> list[str]:
    manifest = read_manifest(store)
    return manifest.filter(pc.equal(manifest["shard_id"], shard_id))["sample_id"].to_pylist()


def test_hybrid_regenerates_a_corrupt_shard_offline_names_it(extraction_server, write_recipe, tmp_path: Path):
    recipe = write_recipe(extraction_server.url, store=str(tmp_path / "store"))
    plan = Plan.load(recipe)
    assert run_extraction(plan, launch=None).ok
    store = Store(plan.data)
    ids = shard_samples(store, "000001")
    before = SampleSource(plan, mode="offline").load(ids)
    forget_verified()
    flip_a_bit(store, "000001")
    assert not verify(store).ok

    forget_verified()
    with pytest.raises(CorruptShardError) as info:
        SampleSource(plan, mode="offline").load(ids)
    message = str(info.value)
    assert "shard 000001" in message and f"draftflow extract {plan.recipe_path}" in message

    forget_verified()
    after = SampleSource(plan, mode="hybrid").load(ids)
    for got, want in zip(after, before, strict=True):
        assert got.sample_id == want.sample_id and torch.equal(got.hidden_states, want.hidden_states)
    manifest = read_manifest(store)
    attempts = set(manifest.filter(pc.equal(manifest["shard_id"], "000001"))["attempt"].to_pylist())
    assert attempts == {2}  # the regenerated commit won
    assert verify(store).ok and shard_samples(store, "000001") == ids
