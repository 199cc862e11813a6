"""Run a coroutine to completion from synchronous code, whatever the caller's event-loop state;
run async work over many items with bounded concurrency."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Callable, Sequence
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


async def run_pool(indices: Sequence[int], work: Callable[[int], Awaitable[None]], concurrency: int) -> None:
    """Run ``work`` on every index with at most ``concurrency`` in flight; cancels the rest on error."""
    pending = iter(indices)

    async def worker() -> None:
        for i in pending:  # the shared iterator hands each index to exactly one worker
            await work(i)

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(concurrency, len(indices))))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        # gather leaves the other workers running on the caller's loop: stop them first.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
