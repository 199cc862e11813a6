"""Fixtures for the extraction tests: one SmolLM2 extraction server and tiny recipes that use it.

Only one vLLM server may run on this host at a time: the server comes from the session-wide
`vllm_servers` fixture, which returns the running one when the settings are the same, so every
module here (and tests/prefect) shares a single server (~30 s to start).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from extraction_helpers import LAYER_IDS, write_recipe_file

from draftflow.store import forget_verified


@pytest.fixture(autouse=True)
def _fresh_verified_cache():
    # The per-process record of verified shards would otherwise leak between tests.
    forget_verified()
    yield
    forget_verified()


@pytest.fixture(scope="module")
def extraction_server(vllm_servers, smollm2_dir: Path, staging_dir: Path):
    """SmolLM2 (fp32, CPU) extracting LAYER_IDS; the pool's, shared by every test that asks for it."""
    return vllm_servers.get(
        smollm2_dir, extract_layer_ids=LAYER_IDS, staging_dir=str(staging_dir), max_model_len=1024
    )


@pytest.fixture
def write_recipe(tmp_path: Path, smollm2_dir: Path, staging_dir: Path):
    """write_recipe(endpoint, store=..., **data_overrides) -> path of a recipe YAML in tmp_path."""

    def write(endpoint: str, store: str | None = None, name: str = "recipe.yaml", **data) -> str:
        return write_recipe_file(
            tmp_path / name, smollm2_dir, store or str(tmp_path / "store"), endpoint, str(staging_dir), **data
        )

    return write
