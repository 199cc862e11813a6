"""Test-only fault injection for extraction; never set these variables outside tests.

:data:`FAULT_SHARDS_ENV` (``DRAFTFLOW_TEST_FAIL_SHARDS``) lists shard ids, e.g.
``000001,000003``: :func:`draftflow.extraction.extract_shard` of those shards raises
:class:`InjectedFault` after extracting and before writing, so nothing is committed. With
:data:`FAULT_ONCE_DIR_ENV` (``DRAFTFLOW_TEST_FAIL_ONCE_DIR``) set to a folder, each listed
shard fails only once: a marker file there records the failure across processes, so a
retried task or flow run succeeds — what a retry test needs.
"""

from __future__ import annotations

import os

from draftflow import paths

FAULT_SHARDS_ENV = "DRAFTFLOW_TEST_FAIL_SHARDS"
FAULT_ONCE_DIR_ENV = "DRAFTFLOW_TEST_FAIL_ONCE_DIR"


class InjectedFault(RuntimeError):
    """Raised by the test-only fault hook."""


def injected_fault(shard_id: str) -> None:
    """The test-only fault hook (module docstring): raise for listed shards, once each if asked."""
    listed = {s.strip() for s in os.environ.get(FAULT_SHARDS_ENV, "").split(",") if s.strip()}
    if shard_id not in listed:
        return
    once_dir = os.environ.get(FAULT_ONCE_DIR_ENV)
    if once_dir:
        os.makedirs(once_dir, exist_ok=True)
        try:  # O_EXCL: exactly one attempt per shard id fails, across processes
            os.close(os.open(os.path.join(once_dir, paths.safe_component(shard_id)), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    raise InjectedFault(f"test fault injected for shard {shard_id} ({FAULT_SHARDS_ENV})")
