"""Fixtures for the extraction tests: one SmolLM2 extraction server and tiny recipes that use it.

The server is `extraction_server` (tests/conftest.py): the pool's, shared with tests/prefect.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from extraction_helpers import write_recipe_file

from draftflow.store import forget_verified


@pytest.fixture(autouse=True)
def _fresh_verified_cache():
    # The per-process record of verified shards would otherwise leak between tests.
    forget_verified()
    yield
    forget_verified()


@pytest.fixture
def write_recipe(tmp_path: Path, smollm2_dir: Path, staging_dir: Path):
    """write_recipe(endpoint, store=..., **data_overrides) -> path of a recipe YAML in tmp_path."""

    def write(endpoint: str, store: str | None = None, name: str = "recipe.yaml", **data) -> str:
        return write_recipe_file(
            tmp_path / name, smollm2_dir, store or str(tmp_path / "store"), endpoint, str(staging_dir), **data
        )

    return write
