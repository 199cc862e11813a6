"""Extracting samples and whole shards through a vLLM client, and committing them.

A sample the server rejects (HTTP 400/413/422) or returns invalid becomes a
:class:`FailedSample` with the reason: recorded in the shard's fragment, never stored as
data, and retried by the next run. A server that is down or misconfigured raises instead,
because that is no fault of the sample and would otherwise mark every sample failed.
A server error (5xx) that only some samples of a shard get is theirs: each is tried once more
on its own, and one that fails again is recorded as failed while the rest are committed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from draftflow import paths
from draftflow.async_run import run_coroutine
from draftflow.extraction.faults import injected_fault, injected_hold
from draftflow.extraction.samples import TrainSet, plan_shard, train_set
from draftflow.plan import Plan
from draftflow.recipe.load import expand
from draftflow.store import ExtractionInfo, FailedSample, PlannedShard, Sample, Store, write_shard
from draftflow.store.shard import as_stored
from draftflow.vllm.client import (
    RETRYABLE_STATUS_MIN,
    InvalidHiddenStates,
    RequestFailed,
    VLLMClient,
    VLLMError,
)
from draftflow.vllm.hidden_states_file import sweep_stale
from draftflow.vllm.server import ServerHandle, with_restarts

# HTTP statuses that mean "this prompt is unacceptable" (too long, bad tokens), not "the server
# is broken" (5xx) or "we are misconfigured" (401/403/404: every sample would fail the same way).
_SAMPLE_REJECTED = frozenset({400, 413, 422})
STALE_STAGING_S = 600.0  # a staging file this old belongs to no live request


@dataclass(frozen=True)
class ShardResult:
    """Outcome of one shard; small and picklable (a Prefect task result). ``samples`` only on request."""

    shard_id: str
    attempt: int
    samples_ok: int
    samples_failed: int
    tokens: int
    seconds: float
    shard_url: str | None  # None when skipped
    fragment_url: str | None = None  # the commit record (None when skipped)
    failures: tuple[tuple[str, str], ...] = ()  # (sample_id, reason)
    skipped: bool = False  # already complete: nothing was requested or written
    samples: tuple[Sample, ...] = field(default=(), repr=False, compare=False)


def extraction_info(plan: Plan, mode: str, vllm_version: str | None) -> ExtractionInfo:
    """What produced the shards, as the manifest records it (target as the recipe spells it)."""
    return ExtractionInfo(
        dtype=plan.recipe.extraction.dtype,
        layer_ids=tuple(plan.layer_ids),
        hidden_size=plan.target.hidden_size,
        target=plan.recipe.target.model,
        target_revision=plan.recipe.target.revision,
        mode=mode,
        vllm_version=vllm_version or None,
    )


def make_client(plan: Plan, endpoints: Sequence[str], api_key: str | None = None) -> VLLMClient:
    """A client with the recipe's request settings that rejects files of the wrong shape."""
    x = plan.recipe.extraction
    return VLLMClient(
        list(endpoints),
        api_key=api_key,
        concurrency=x.concurrency,
        retries=x.request_retries,
        timeout_s=x.request_timeout_s,
        num_layers=len(plan.layer_ids),
        hidden_size=plan.target.hidden_size,
        staging_dirs=staging_folders(plan),
    )


def staging_folders(plan: Plan) -> list[str]:
    """The recipe's staging folders, expanded: the only places a server-named file is touched."""
    return [expand(d) for d in plan.recipe.vllm.staging_folders()]


def server_error(result: object) -> bool:
    return isinstance(result, RequestFailed) and result.status >= RETRYABLE_STATUS_MIN


def sweep_staging(plan: Plan, staging_dirs: Sequence[str] | None = None) -> int:
    """Remove staging files that killed clients left (never read, never deleted; the folder is
    often RAM). Only files far older than any request can be are touched, only names the
    connector writes, and only in the recipe's staging folders (never one a server's answer
    named). Every path that extracts calls it, at its start and at its end."""
    older_than_s = max(STALE_STAGING_S, 2 * plan.recipe.extraction.request_timeout_s)
    folders = sorted(set(staging_folders(plan) if staging_dirs is None else staging_dirs))
    return sum(sweep_stale(folder, older_than_s) for folder in folders if os.path.isdir(folder))


def sample_failure(err: VLLMError) -> str | None:
    """The reason to record when ``err`` is the sample's own fault; None when it is not."""
    if isinstance(err, _OwnServerError):
        return f"server error on every attempt, alone too: HTTP {err.status}: {err.message}"[:500]
    if isinstance(err, InvalidHiddenStates):
        return f"invalid hidden states: {err.reason}"[:500]
    if isinstance(err, RequestFailed) and err.status in _SAMPLE_REJECTED:
        return f"rejected by the server: HTTP {err.status}: {err.message}"[:500]
    return None


async def extract_samples(
    train: TrainSet,
    sample_ids: Sequence[str],
    client: VLLMClient,
    *,
    dtype: str,
    on_sample: Callable[[int, bool], None] | None = None,
) -> list[Sample | FailedSample]:
    """Hidden states of ``sample_ids`` (in order) as ``dtype`` gives them back; nothing is stored.

    FP8 dtypes give fp32 states already quantised and decoded (:func:`as_stored`), so an
    online or hybrid trainer sees exactly what a later read of the store returns.

    The client deletes every staging file right after reading it. ``on_sample(num_tokens, ok)``
    is called as each sample finishes.
    """
    tokens = [train.tokens(sid) for sid in sample_ids]

    def finished(i: int, result: Any) -> None:
        if on_sample is not None:
            on_sample(len(tokens[i][0]), not isinstance(result, VLLMError))

    requests = [(sid, ids.tolist()) for sid, (ids, _) in zip(sample_ids, tokens, strict=True)]
    # A 5xx may be tried again below: its sample is reported once it is settled.
    first = await client.extract_many(
        requests, on_result=lambda i, result: None if server_error(result) else finished(i, result)
    )
    results = await _retry_server_errors_alone(client, requests, first)
    for i, result in enumerate(first):
        if server_error(result):
            finished(i, results[i])
    out: list[Sample | FailedSample] = []
    for sid, (ids, mask), result in zip(sample_ids, tokens, results, strict=True):
        if isinstance(result, VLLMError):
            reason = sample_failure(result)
            if reason is None:
                raise result
            out.append(FailedSample(sid, reason, len(ids)))
            continue
        # Token ids as prepared (int32, half the bytes); the client checked they equal the file's.
        hidden = as_stored(result.hidden_states, dtype)
        out.append(Sample(sid, hidden, torch.from_numpy(ids), torch.from_numpy(mask)))
    return out


class _OwnServerError(RequestFailed):
    """A 5xx a sample got on every attempt, alone too, while the server answered the others."""


async def _retry_server_errors_alone(
    client: VLLMClient, requests: list[tuple[str, list[int]]], results: list
) -> list:
    """Try each sample that got a 5xx once more on its own, when others of the batch succeeded
    (so the server works). When none succeeded the server is at fault and nothing changes: the
    shard raises, and its caller restarts the server and runs the shard again."""
    failed = [i for i, r in enumerate(results) if server_error(r)]
    if not failed or all(server_error(r) or isinstance(r, VLLMError) for r in results):
        return results
    results = list(results)
    for i in failed:
        [again] = await client.extract_many([requests[i]])
        if server_error(again):
            again = _OwnServerError(again.endpoint, again.status, again.message)
        results[i] = again
    return results


def _check_plan(train: TrainSet, shard: PlannedShard) -> None:
    """A plan made for another dataset must not write under this one's shard ids."""
    positions = [train.positions.get(sid) for sid in shard.sample_ids]
    if shard.shard_id != paths.shard_id(shard.index) or positions != list(range(shard.start, shard.stop)):
        raise ValueError(f"planned shard {shard.shard_id} does not match the prepared train split")


async def extract_shard(
    plan: Plan,
    store: Store,
    shard: PlannedShard,
    client: VLLMClient,
    *,
    mode: str = "offline",
    vllm_version: str | None = None,
    train: TrainSet | None = None,
    on_sample: Callable[[int, bool], None] | None = None,
    return_samples: bool = False,
) -> ShardResult:
    """Extract every sample of ``shard`` and commit it (failures recorded with their reasons).

    ``mode`` is recorded in the manifest: "offline" for the extraction stage, "online" for
    shards a hybrid trainer generated on demand. ``return_samples`` keeps the stored samples
    in the result (the hybrid trainer uses them at once instead of reading them back).
    """
    started = time.monotonic()
    train = train_set(store) if train is None else train
    _check_plan(train, shard)
    if vllm_version is None:
        vllm_version = await client.version()
    dtype = plan.recipe.extraction.dtype
    samples = await extract_samples(train, shard.sample_ids, client, dtype=dtype, on_sample=on_sample)
    injected_fault(shard.shard_id)
    injected_hold(shard.shard_id)
    info = extraction_info(plan, mode, vllm_version)
    # The write hashes and uploads the shard: off the event loop, so other shards keep extracting.
    committed = await asyncio.to_thread(
        write_shard, store, shard.shard_id, samples, info, attempt=shard.attempt
    )
    good = tuple(s for s in samples if isinstance(s, Sample))
    return ShardResult(
        shard_id=shard.shard_id,
        attempt=shard.attempt,
        samples_ok=committed.samples_ok,
        samples_failed=committed.samples_failed,
        tokens=sum(s.num_tokens for s in good),
        seconds=time.monotonic() - started,
        shard_url=committed.shard_url,
        fragment_url=committed.fragment_url,
        failures=tuple((s.sample_id, s.reason) for s in samples if isinstance(s, FailedSample)),
        samples=good if return_samples else (),
    )


def extract_shard_by_id(
    plan: Plan,
    shard_id: str,
    endpoints: Sequence[str],
    api_key: str | None = None,
    storage_options: dict | None = None,
    *,
    verify: bool | str = True,
    server: ServerHandle | None = None,
) -> ShardResult:
    """Extract one shard of ``plan`` by its id (the Prefect shard task's body).

    Idempotent: a shard that is already complete (and verifies) is skipped, so a rerun or a
    retried flow only does what is missing. The servers must be up (the flow checks them once
    with :func:`draftflow.vllm.server.ensure_running`); the data must be prepared. `server`: that
    check's handle, when this process holds it; a server of it that dies mid-shard is started
    again (when it has launch settings) and the shard runs again whole.
    """
    store = Store(plan.data, dict(storage_options or {}))
    planned = plan_shard(plan, store, shard_id, verify=verify)
    if planned is None:
        return ShardResult(shard_id, 0, 0, 0, 0, 0.0, None, skipped=True)

    from draftflow.progress import stage

    async def go() -> ShardResult:
        progress = stage(f"extract shard {shard_id}", len(planned.sample_ids), unit="samples")

        async def attempt() -> ShardResult:
            async with make_client(plan, endpoints, api_key) as client:
                return await extract_shard(
                    plan,
                    store,
                    planned,
                    client,
                    on_sample=lambda _tokens, ok: progress.advance(failed=int(not ok)),
                )

        try:
            return await with_restarts(attempt, server)
        finally:
            progress.close()

    return run_coroutine(go())
