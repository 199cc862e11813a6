"""Fault injection for extraction, for tests (and the docs' screenshot script, which shows a
failed shard retried); never set these variables on a real run.

:data:`FAULT_SHARDS_ENV` (``DRAFTFLOW_TEST_FAIL_SHARDS``) lists shard ids, e.g.
``000001,000003``: :func:`draftflow.extraction.extract_shard` of those shards raises
:class:`InjectedFault` after extracting and before writing, so nothing is committed. With
:data:`FAULT_ONCE_DIR_ENV` (``DRAFTFLOW_TEST_FAIL_ONCE_DIR``) set to a folder, each listed
shard fails only once: a marker file there records the failure across processes, so a
retried task or flow run succeeds — what a retry test needs.

:data:`HOLD_SHARDS_ENV` (``DRAFTFLOW_TEST_HOLD_SHARDS``) with :data:`HOLD_DIR_ENV`
(``DRAFTFLOW_TEST_HOLD_DIR``): the first attempt of each listed shard, at the same point
(extracted, nothing committed), writes ``<dir>/<shard>.held`` holding its process id and
sleeps, so a test can kill that process mid-shard; later attempts go on.
"""

from __future__ import annotations

import os
import time

from draftflow import paths

FAULT_SHARDS_ENV = "DRAFTFLOW_TEST_FAIL_SHARDS"
FAULT_ONCE_DIR_ENV = "DRAFTFLOW_TEST_FAIL_ONCE_DIR"
HOLD_SHARDS_ENV = "DRAFTFLOW_TEST_HOLD_SHARDS"
HOLD_DIR_ENV = "DRAFTFLOW_TEST_HOLD_DIR"
HOLD_S = 120.0  # bounded: a test that never kills the holder still ends


class InjectedFault(RuntimeError):
    """Raised by the test-only fault hook."""


def _listed(variable: str, shard_id: str) -> bool:
    return shard_id in {s.strip() for s in os.environ.get(variable, "").split(",") if s.strip()}


def injected_fault(shard_id: str) -> None:
    """The test-only fault hook (module docstring): raise for listed shards, once each if asked."""
    if not _listed(FAULT_SHARDS_ENV, shard_id):
        return
    once_dir = os.environ.get(FAULT_ONCE_DIR_ENV)
    if once_dir:
        os.makedirs(once_dir, exist_ok=True)
        try:  # O_EXCL: exactly one attempt per shard id fails, across processes
            os.close(os.open(os.path.join(once_dir, paths.safe_component(shard_id)), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    raise InjectedFault(f"test fault injected for shard {shard_id} ({FAULT_SHARDS_ENV})")


def injected_hold(shard_id: str) -> None:
    """The test-only hold (module docstring): the first attempt of a listed shard records its pid
    and sleeps until killed (at most HOLD_S)."""
    folder = os.environ.get(HOLD_DIR_ENV)
    if not folder or not _listed(HOLD_SHARDS_ENV, shard_id):
        return
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(folder, paths.safe_component(shard_id) + ".held")
    try:  # O_EXCL: only the first attempt, in whichever process, holds
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(HOLD_S)
