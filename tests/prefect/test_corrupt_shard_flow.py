"""A same-size bit flip in a shard is repaired by the extract flow on a real Prefect server,
although the shard's task result is cached, and the run's shard table says so."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest
from prefect_helpers import shard_table_rows, write_tiny_recipe

from draftflow.plan import Plan
from draftflow.store import Store, load_sample, read_manifest, verify

pytestmark = pytest.mark.slow


def test_flipped_bit_is_repaired_by_the_extract_flow(
    prefect_server, extraction_endpoint, staging_dir, smollm2_dir: Path, tmp_path: Path
):
    from flows.stages import extract

    recipe = write_tiny_recipe(
        tmp_path / "recipe.yaml",
        smollm2_dir,
        str(tmp_path / "store"),
        extraction_endpoint,
        name="prefect-bitflip",
        staging=str(staging_dir),
    )
    assert extract(recipe).failed == 0
    store = Store(Plan.load(recipe).data)
    manifest = read_manifest(store)
    victim = manifest.filter(pc.equal(manifest["shard_id"], "000001"))
    original = {sid: load_sample(store, manifest, sid) for sid in victim["sample_id"].to_pylist()}
    url = store.layout.resolve_shard_key(victim["shard_uri"][0].as_py())
    blob = bytearray(Path(url).read_bytes())
    blob[-16] ^= 0x04  # same size, header intact: only a hash can tell
    with open(url, "r+b") as f:
        f.write(blob)
    assert not verify(store).ok

    assert extract(recipe).failed == 0  # the same flow again; its shard tasks are cached
    assert verify(store).ok
    manifest = read_manifest(store)
    repaired = manifest.filter(pc.equal(manifest["shard_id"], "000001"))
    assert set(repaired["attempt"].to_pylist()) == {2}
    for sid, want in original.items():
        got = load_sample(store, manifest, sid)
        assert got.hidden_states.equal(want.hidden_states) and got.token_ids.equal(want.token_ids)
    rows = shard_table_rows("prefect-bitflip-shards")
    assert rows["000001"]["status"] == "regenerated" and "sha256 mismatch" in rows["000001"]["reason"]
    assert all(r["status"] != "regenerated" for s, r in rows.items() if s != "000001")
