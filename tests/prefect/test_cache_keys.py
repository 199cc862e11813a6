"""The shard cache key: what the data is (fingerprint), where it goes (store), which shard, which format."""

from __future__ import annotations

from pathlib import Path

from prefect_helpers import write_tiny_recipe

from draftflow.plan import Plan
from draftflow.run_ref import RunRef
from draftflow.store.shard import FORMAT_VERSION
from tasks.extract import shard_cache_key


def test_shard_cache_key_names_fingerprint_store_shard_and_format(smollm2_dir: Path, tmp_path: Path):
    recipe = write_tiny_recipe(
        tmp_path / "recipe.yaml", smollm2_dir, str(tmp_path / "a"), "http://127.0.0.1:9"
    )
    fingerprint = Plan.load(recipe).fingerprint

    def key(shard: str = "000001", overrides: tuple[str, ...] = ()) -> str:
        ref, _ = RunRef.create(recipe, list(overrides))
        return shard_cache_key(None, {"ref": ref, "shard": shard, "server_ref": None})

    moved = (f"extraction.store={tmp_path / 'b'}",)
    assert Plan.load(recipe, list(moved)).fingerprint == fingerprint  # same data, another place
    assert key() == key() and key() != key(overrides=moved)  # a new store is not "already done"
    assert key().startswith(f"draftflow-shard-{fingerprint}-") and key().endswith(
        f"-000001-format{FORMAT_VERSION}"
    )
    assert key("000002") != key()
    # training settings change neither the data nor where it lives
    assert key(overrides=("training.epochs=7",)) == key()
