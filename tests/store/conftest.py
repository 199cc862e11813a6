"""Fixtures for the store tests: one data folder per test on a local disk, /dev/shm or S3 (moto)."""

from __future__ import annotations

import shutil
import tempfile
import uuid

import pytest

from draftflow.store import Store, forget_verified

BACKENDS = ["local", "shm", pytest.param("s3", marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _fresh_verified_cache():
    # The per-process record of verified shards would otherwise leak between tests.
    forget_verified()
    yield
    forget_verified()


@pytest.fixture
def shm_dir():
    path = tempfile.mkdtemp(prefix="draftflow-store-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_store(request, tmp_path):
    """``make_store(backend)`` -> a fresh, empty data folder on that backend."""

    def make(backend: str) -> Store:
        if backend == "local":
            return Store.at(str(tmp_path / f"data-{uuid.uuid4().hex[:8]}"))
        if backend == "shm":
            return Store.at(request.getfixturevalue("shm_dir") + f"/data-{uuid.uuid4().hex[:8]}")
        s3 = request.getfixturevalue("s3")
        return Store.at(f"{s3['url']}/{uuid.uuid4().hex}/data", s3["storage_options"])

    return make


@pytest.fixture(params=BACKENDS)
def store(request, make_store) -> Store:
    """A fresh, empty data folder on each backend in turn."""
    return make_store(request.param)


@pytest.fixture
def local_store(tmp_path) -> Store:
    return Store.at(str(tmp_path / "data"))
