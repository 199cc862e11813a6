"""Publishing to loopback S3 through a CheckpointDestination block: folder + model card, one version
per checkpoint however often it is pushed, and nothing at all when the gate fails."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
from prefect_helpers import checkpoint_and_report, write_publish_recipe

from blocks.infrastructure import CheckpointDestination
from draftflow.paths import MODEL_CARD, RELEASE_HISTORY_SUFFIX, RELEASE_POINTER_SUFFIX
from draftflow.publish import PUBLISHED_MARKER
from flows.stages import publish


@pytest.fixture
def destination(prefect_server, s3):
    """(block name, s3 URL, fs) of an empty prefix; credentials in the block's secret fields."""
    url = f"{s3['url']}/published-{uuid.uuid4().hex[:8]}"
    options = s3["storage_options"]
    name = f"dest-{uuid.uuid4().hex[:8]}"
    CheckpointDestination(
        url=url,
        storage_options={"client_kwargs": options["client_kwargs"]},
        access_key_id=options["key"],
        secret_access_key=options["secret"],
    ).save(name)
    fs, _ = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    return name, url, fs


def listing(fs, url: str) -> list[str]:
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return sorted(p.removeprefix(root + "/") for p in fs.find(root))


@pytest.mark.slow
def test_publish_writes_folder_and_card_once(destination, tiny_llama_dir: Path, tmp_path: Path):
    name, url, fs = destination
    recipe = write_publish_recipe(tmp_path / "recipe.yaml", tiny_llama_dir)
    checkpoint, report = checkpoint_and_report(tiny_llama_dir, tmp_path, tau=1.8)

    first = publish(recipe, checkpoint, report, destination_block=name)
    assert first.pushed and first.location == f"{url}/prefect-publish-{first.version}"
    files = listing(fs, url)
    version_dir = f"prefect-publish-{first.version}"
    local = sorted(p.relative_to(checkpoint).as_posix() for p in Path(checkpoint).rglob("*") if p.is_file())
    release_files = [f"prefect-publish{RELEASE_POINTER_SUFFIX}", f"prefect-publish{RELEASE_HISTORY_SUFFIX}"]
    assert files == sorted(
        [f"{version_dir}/{f}" for f in local] + [f"{version_dir}/{PUBLISHED_MARKER}"] + release_files
    )
    pointer = json.loads(fs.cat(f"{url.removeprefix('s3://')}/{release_files[0]}"))
    assert pointer["version"] == first.version  # the release in service
    assert {"README.md", "config.json", "model.safetensors", "acceptance.png"} <= set(local)
    card = fs.cat(f"{url.removeprefix('s3://')}/{version_dir}/{MODEL_CARD}").decode()
    assert card.startswith("---\n") and "\n---\n# prefect-publish: a dflash drafter for" in card
    assert "gate passed: τ 1.800" in card
    assert first.location in card  # served from the published copy
    assert "![Per-position acceptance](acceptance.png)" in card

    second = publish(recipe, checkpoint, report, destination_block=name)
    assert (second.pushed, second.location, second.version) == (False, first.location, first.version)
    assert listing(fs, url) == files


@pytest.mark.slow
def test_failed_gate_pushes_nothing(destination, tiny_llama_dir: Path, tmp_path: Path):
    name, url, fs = destination
    recipe = write_publish_recipe(tmp_path / "recipe.yaml", tiny_llama_dir)
    checkpoint, report = checkpoint_and_report(tiny_llama_dir, tmp_path, tau=1.0)
    state = publish(recipe, checkpoint, report, destination_block=name, return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError, match=r"gate failed: τ 1.000 < evaluation.min_acceptance_length 1.05"):
        state.result()
    assert listing(fs, url) == []
    assert not (Path(checkpoint) / MODEL_CARD).exists()
