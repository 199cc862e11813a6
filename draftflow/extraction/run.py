"""The whole extraction stage in one process: servers, preparation, reconcile, missing shards."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
from collections.abc import Callable, Sequence

from draftflow.async_run import run_coroutine
from draftflow.data.chat import load_chat_encoder
from draftflow.data.dataset import is_prepared
from draftflow.data.prepare import aprepare
from draftflow.data.segments import earlier_sample_ids
from draftflow.data.self_generated import Sampled
from draftflow.extraction.progress import (
    ExtractionProgress,
    ExtractionSummary,
    ProgressTracker,
)
from draftflow.extraction.samples import train_set
from draftflow.extraction.shards import (
    ShardResult,
    extract_shard,
    make_client,
    staging_folders,
    sweep_staging,
)
from draftflow.plan import Plan
from draftflow.recipe.fingerprint import fingerprint_inputs
from draftflow.recipe.schema import DataSection, Recipe, VLLMLaunchSection
from draftflow.store import PlannedShard, Store, reconcile
from draftflow.store.fp8 import server_dtype
from draftflow.vllm.client import VLLMClient
from draftflow.vllm.plain_server import ensure_plain_running
from draftflow.vllm.server import ServerHandle, ensure_running, with_restarts

log = logging.getLogger(__name__)

_RECIPE = object()  # run_extraction(launch=...) default: take the recipe's vllm.launch


def run_extraction(
    plan: Plan,
    *,
    storage_options: dict | None = None,
    endpoints: Sequence[str] | None = None,
    api_key: str | None = None,
    launch: VLLMLaunchSection | None | object = _RECIPE,
    progress: Callable[[ExtractionProgress], None] | None = None,
    verify: bool = True,
    shards_in_flight: int | None = None,
    log_dir: str | None = None,
) -> ExtractionSummary:
    """Make the recipe's data folder complete: server, preparation, reconcile, missing shards only.

    ``endpoints`` / ``launch`` default to the recipe's ``vllm`` section (``launch=None``: never
    start a server). Shards are extracted ``shards_in_flight`` at a time (default two per
    endpoint), each spread over all endpoints, so no server idles while a shard is written.
    """
    recipe = plan.recipe
    store = Store(plan.data, dict(storage_options or {}))
    urls = list(endpoints or recipe.vllm.endpoints)
    tracker = ProgressTracker(progress)
    launch = recipe.vllm.launch if launch is _RECIPE else launch
    if needs_generation(recipe.data) and not is_prepared(store.layout, store.storage_options):
        tracker.stage("prepare", f"generating data in {store.layout.prepared_dir} (plain vLLM server)")
        prepare_data(
            plan, urls, api_key=api_key, storage_options=store.storage_options, launch=launch, log_dir=log_dir
        )
    tracker.stage("server", f"checking vLLM at {', '.join(urls)}")
    handle = ensure_running(
        urls,
        model=plan.target_model,
        layer_ids=plan.layer_ids,
        hidden_size=plan.target.hidden_size,
        api_key=api_key,
        launch=launch,
        # The server computes in the stored dtype, so what is stored is what it computed
        # (FP8: in bf16, quantised when the shard is written).
        dtype=server_dtype(recipe.extraction.dtype),
        log_dir=log_dir,
        staging_dirs=staging_folders(plan),
        min_model_len=recipe.data.max_length + 1,
    )
    with handle:
        summary = run_coroutine(
            _extract_missing(
                plan,
                store,
                handle.endpoints,
                api_key,
                tracker,
                verify,
                shards_in_flight or 2 * len(urls),
                server=handle,
            )
        )
    return summary.with_server(bool(handle.started), tuple(handle.unverified))


async def _extract_missing(
    plan: Plan,
    store: Store,
    endpoints: list[str],
    api_key: str | None,
    tracker: ProgressTracker,
    verify: bool,
    shards_in_flight: int,
    server: ServerHandle | None = None,
) -> ExtractionSummary:
    # Files of clients killed mid-request (never read, never deleted) go first, not only after
    # a run that succeeds; only files far older than any request are touched.
    early = await asyncio.to_thread(sweep_staging, plan)
    if not await asyncio.to_thread(is_prepared, store.layout, store.storage_options):
        tracker.stage("prepare", f"preparing data in {store.layout.prepared_dir}")
        await _prepare(plan, store, endpoints, api_key)
    await asyncio.to_thread(_write_fingerprint, plan, store)
    tracker.stage(
        "reconcile", f"reconciling {store.layout.root}" + (" (re-hashing shards)" if verify else "")
    )
    train = await asyncio.to_thread(train_set, store)
    per_shard = plan.recipe.extraction.samples_per_shard
    rec = await asyncio.to_thread(reconcile, store, train.expected(), per_shard, verify=verify)
    tracker.begin(rec, len(train.positions))
    results: list[ShardResult] = []
    version, swept = None, 0
    if rec.to_generate:
        async with make_client(plan, endpoints, api_key) as client:
            version = await client.version()
            limit = asyncio.Semaphore(shards_in_flight)

            async def one(shard: PlannedShard) -> ShardResult:
                async def attempt() -> ShardResult:
                    async with limit:
                        return await extract_shard(
                            plan,
                            store,
                            shard,
                            client,
                            vllm_version=version,
                            train=train,
                            on_sample=tracker.sample,
                        )

                # A server that died is started again (launch settings) and the shard runs again
                # whole: nothing of it was committed.
                result = await with_restarts(attempt, server)
                tracker.shard_done(result)
                return result

            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(s)) for s in rec.to_generate]
            except* Exception as errors:  # committed shards stay; a rerun does the rest
                raise errors.exceptions[0] from None
            results = [t.result() for t in tasks]
            swept = await asyncio.to_thread(sweep_staging, plan, client.staging_dirs)
    swept += early
    tracker.stage("done", "extraction finished" + (f"; removed {swept} stale staging files" if swept else ""))
    return tracker.summary(store.layout.root, results, version)


def needs_generation(data: DataSection) -> bool:
    """Whether preparing ``data`` asks the target to write text (replies or self-generated prompts)."""
    return data.regenerate_responses or any(s.kind == "self_generated" for s in data.sources)


def generation_dtype(recipe: Recipe) -> str:
    """What the plain server that writes text computes in: ``data.generation_dtype``, else the
    extraction server's dtype (bfloat16 for an FP8 store: FP8 is a storage format, not one vLLM runs in)."""
    return recipe.data.generation_dtype or server_dtype(recipe.extraction.dtype)


def prepare_data(
    plan: Plan,
    endpoints: Sequence[str] | None = None,
    *,
    api_key: str | None = None,
    storage_options: dict | None = None,
    launch: VLLMLaunchSection | None = None,
    log_dir: str | None = None,
) -> bool:
    """Prepare the recipe's data folder unless it is complete; True when work was done.

    When the target must write text, the servers at ``endpoints`` (default: the recipe's) are
    used if they answer; dead ones get a *plain* server from ``launch`` (generation runs at
    plain-server speed), stopped again before this returns. For a flow that runs preparation
    as a task of its own before the extraction server starts.
    """
    store = Store(plan.data, dict(storage_options or {}))
    if is_prepared(store.layout, store.storage_options):
        return False
    urls = list(endpoints or plan.recipe.vllm.endpoints)
    if needs_generation(plan.recipe.data):
        with ensure_plain_running(
            urls,
            model=plan.target_model,
            api_key=api_key,
            launch=launch,
            dtype=generation_dtype(plan.recipe),
            log_dir=log_dir,
            staging_dirs=staging_folders(plan),
            min_model_len=plan.recipe.data.max_length + 1,
            sampled=any(s.kind == "self_generated" for s in plan.recipe.data.sources),
        ) as handle:
            run_coroutine(_prepare(plan, store, handle.endpoints, api_key))
    else:
        run_coroutine(_prepare(plan, store, urls, api_key))
    _write_fingerprint(plan, store)
    return True


async def _prepare(plan: Plan, store: Store, endpoints: list[str], api_key: str | None) -> None:
    """Preparation, regenerating replies through the extraction servers when the recipe asks.

    Regeneration requests on an extraction server also write hidden-state files; the client's
    ``chat`` deletes them. Requests go round-robin over the endpoints.
    """
    data = plan.recipe.data
    encoder = await asyncio.to_thread(load_chat_encoder, plan.recipe.target)
    segments = {}
    if plan.window is not None:
        earlier = await asyncio.to_thread(
            earlier_sample_ids, plan.store, plan.recipe.name, plan.fingerprint, store.storage_options
        )
        segments = {"window": plan.window, "earlier": earlier}
    if not needs_generation(data):
        await aprepare(data, store.layout, encoder, storage_options=store.storage_options, **segments)
        return
    per_endpoint = math.ceil(data.regenerate_concurrency / len(endpoints))
    async with VLLMClient(
        endpoints,
        api_key=api_key,
        concurrency=per_endpoint,
        retries=plan.recipe.extraction.request_retries,
        timeout_s=plan.recipe.extraction.request_timeout_s,
        staging_dirs=staging_folders(plan),
    ) as client:
        turn = itertools.cycle(client.endpoints)

        async def generate(messages: list[dict], max_tokens: int) -> str:
            return await client.chat(messages, max_tokens, endpoint=next(turn))

        async def sample(
            ids: list[int], max_tokens: int, temperature: float, top_p: float, seed: int
        ) -> Sampled:
            out = await client.sample(ids, max_tokens, temperature, top_p, seed, endpoint=next(turn))
            return Sampled(out.text, out.finish_reason)

        await aprepare(
            data,
            store.layout,
            encoder,
            generate=generate,
            storage_options=store.storage_options,
            regenerate_timeout_s=plan.recipe.extraction.request_timeout_s,
            sample=sample,
            **segments,
        )


def _write_fingerprint(plan: Plan, store: Store) -> None:
    """fingerprint.json: what the folder's fingerprint was computed from (for people, not code)."""
    fs, path = store.fs(store.layout.fingerprint_file)
    if fs.exists(path):
        return
    blob = json.dumps(
        {
            "fingerprint": plan.fingerprint,
            "inputs": fingerprint_inputs(
                plan.recipe, list(plan.layer_ids), store.storage_options, window=plan.window
            ),
        },
        indent=2,
        sort_keys=True,
        default=str,
    ).encode()
    store.write_atomic(store.layout.fingerprint_file, lambda f: f.write(blob))
