"""Response regeneration: the target rewrites the assistant turns of selected conversations.

Drafters learn best on the target's own replies. The vLLM client is injected as an async
``generate(messages, max_tokens) -> str`` so this module has no server dependency and its
plumbing is testable with a fake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from draftflow.async_run import run_pool
from draftflow.data.sources import Conversation
from draftflow.progress import stage

Generate = Callable[[list[dict], int], Awaitable[str]]


class RegenerationError(RuntimeError):
    """The target keeps failing: regeneration stops instead of dropping every conversation."""


async def regenerate_conversations(
    conversations: list[Conversation],
    generate: Generate,
    max_tokens: int,
    concurrency: int,
    timeout_s: float | None = None,
    max_failures_in_a_row: int = 50,
) -> tuple[list[tuple[Conversation | None, str | None]], list[str]]:
    """Replace every assistant turn with the target's reply to the turns before it.

    Replies are generated turn by turn, each conditioned on the already regenerated earlier
    replies, so the assistant side is the target's own (later user turns stay as written).
    At most ``concurrency`` requests are in flight: a fixed pool of workers, not one task per
    conversation, so memory stays flat for large sets. A failed, timed-out or empty reply
    drops that conversation with a reason; cancellation is not caught, so stopping a run
    still stops it. ``max_failures_in_a_row`` failed requests with no success in between
    mean the server is down or broken: that raises RegenerationError at once instead of
    grinding through every conversation into an empty dataset.
    Returns ((conversation, None) or (None, reason)) per input, in order, and a few error
    messages for the report.
    """
    results: list[tuple[Conversation | None, str | None]] = [(None, "regenerate_not_run")] * len(
        conversations
    )
    errors: list[str] = []
    streak = [0]  # failures since the last successful reply, across all workers

    def failed(reason: str) -> tuple[None, str]:
        streak[0] += 1
        if streak[0] >= max_failures_in_a_row:
            raise RegenerationError(
                f"{streak[0]} regeneration requests failed in a row ({reason}); last errors: {errors[-3:]}"
            )
        return None, reason

    async def one(messages: Conversation) -> tuple[Conversation | None, str | None]:
        out = [dict(m) for m in messages]
        for i, m in enumerate(out):
            if m["role"] != "assistant":
                continue
            try:
                call = generate([dict(x) for x in out[:i]], max_tokens)
                reply = await (asyncio.wait_for(call, timeout_s) if timeout_s else call)
            except TimeoutError:
                return failed("regenerate_timeout")
            except Exception as err:  # a server error must cost one sample, not the whole run
                errors.append(f"{type(err).__name__}: {err}"[:300])
                del errors[:-5]  # keep the latest few for the report
                return failed("regenerate_failed")
            if not isinstance(reply, str) or not reply.strip():
                return failed("regenerate_empty")
            streak[0] = 0
            out[i] = {"role": "assistant", "content": reply.strip()}
        return out, None

    progress = stage("regenerating replies", len(conversations), unit="conversations")

    async def work(idx: int) -> None:
        results[idx] = await one(conversations[idx])
        progress.advance(failed=int(results[idx][0] is None))

    try:
        await run_pool(range(len(conversations)), work, concurrency)
    finally:
        progress.close()
    return results, errors
