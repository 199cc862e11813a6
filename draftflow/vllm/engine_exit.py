"""When stopping a vLLM server need not wait any longer: its engine has exited.

The watchdog, run by the vLLM virtualenv's Python, imports it too: standard library and
:mod:`draftflow.process_group` only.

The grace between SIGTERM and SIGKILL is for vLLM's engine (core and workers) to shut down
cleanly. Once the engine is gone the API server has little left to do, and one stopped during
start-up never leaves: vLLM 0.32's API server, sent SIGTERM after its engine core started but
before it answers, waits for an engine that has exited (it outlived 40 s in a probe). So a stop
waits :data:`AFTER_ENGINE_S` after the last engine process, whatever the grace.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from draftflow.process_group import command_line

#: vLLM titles its engine processes ``VLLM::EngineCore``, ``VLLM::Worker``...
ENGINE_TITLE = "VLLM::"
#: How long the API server may take to follow its engine out.
AFTER_ENGINE_S = 3.0


def engine_running(pids: list[int]) -> bool:
    """Whether any of `pids` (a group's live members) is one of vLLM's engine processes."""
    return any(" ".join(command_line(pid)).startswith(ENGINE_TITLE) for pid in pids)


def engine_gone_for(seconds: float = AFTER_ENGINE_S) -> Callable[[list[int]], bool]:
    """A predicate on a group's live members, polled while a stop waits: True once none of them
    has been an engine process for `seconds`."""
    since: list[float] = []

    def gone(pids: list[int]) -> bool:
        if engine_running(pids):
            since.clear()
            return False
        if not since:
            since.append(time.monotonic())
        return time.monotonic() - since[0] >= seconds

    return gone
