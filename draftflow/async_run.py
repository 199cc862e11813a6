"""Run a coroutine to completion from synchronous code, whatever the caller's event-loop state."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any


def run_coroutine(coro: Any) -> Any:
    """asyncio.run, also from code that already runs an event loop (it gets its own thread):
    Prefect tasks and notebooks call the core from inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as err:  # re-raised in the caller's thread
            box["error"] = err

    context = contextvars.copy_context()  # progress sinks (draftflow.progress.reporting) follow
    thread = threading.Thread(target=context.run, args=(target,), name="draftflow-run-coroutine")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
