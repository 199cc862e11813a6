"""Where the trainer's samples come from: the store, vLLM on demand, or both.

Modes (the recipe's ``extraction.mode``):

* ``offline`` — every train sample must be in the store. Opening a source with samples
  missing, failed or in a broken shard fails at once, naming how many and which shards
  (run ``draftflow extract`` first), instead of failing hours into training.
* ``online`` — hidden states are generated through vLLM when a batch is loaded, and never
  stored: the client deletes each staging file right after reading it.

In every mode, samples that cannot be had (missing offline, failed extraction online and in
hybrid) are trained without while they stay within ``training.max_missing_fraction``.
* ``hybrid`` — samples in the store are loaded; a batch that needs missing ones generates
  their whole shards with :func:`draftflow.extraction.extract_shard` and commits them
  (``mode = "online"`` in the manifest), so later epochs and later runs load them. Two ranks
  generating the same shard both commit; the manifest keeps one (see the store's resolve).

:meth:`SampleSource.items` reads no tensors (ids and token counts from the prepared data),
so every rank computes the same packing plan before loading anything. Stored samples are
read with one range read each, checked against the manifest's checksums (``verify``).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

import pyarrow as pa

from draftflow import paths
from draftflow.async_run import run_coroutine
from draftflow.extraction import (
    ShardResult,
    extract_samples,
    extract_shard,
    make_client,
    plan_shard,
    sweep_staging,
    train_set,
)
from draftflow.plan import Plan
from draftflow.process_env import storage_options_from_env, vllm_api_key_from_env
from draftflow.store import (
    CorruptShardError,
    FailedSample,
    PlannedShard,
    Reconciliation,
    Sample,
    Store,
    load_sample,
    read_manifest,
    reconcile,
)
from draftflow.store.manifest import STATUS_OK, from_ipc_bytes
from draftflow.store.reader import Verify

Mode = Literal["offline", "online", "hybrid"]
_SHARDS_NAMED = 20  # an error message names this many shards, then counts the rest


class MissingSamples(LookupError):
    """Offline mode, and the store lacks samples (the message says how many and where)."""


class SampleUnavailable(RuntimeError):
    """A sample generated on demand failed extraction (the reason is in the message)."""


class SampleSource:
    """The train split's samples for the trainer; see the module docstring for the modes."""

    def __init__(
        self,
        plan: Plan,
        *,
        mode: Mode | None = None,
        storage_options: dict | None = None,
        endpoints: Sequence[str] | None = None,
        api_key: str | None = None,
        verify: Verify | None = None,
        max_missing_fraction: float | None = None,
    ):
        self.plan = plan
        self.max_missing_fraction = (
            plan.recipe.training.max_missing_fraction
            if max_missing_fraction is None
            else max_missing_fraction
        )
        self.skipped: dict[str, str] = {}  # samples left out (training.max_missing_fraction) -> why
        self.mode = mode or plan.recipe.extraction.mode
        if self.mode not in ("offline", "online", "hybrid"):
            raise ValueError(f"mode must be offline, online or hybrid, not {self.mode!r}")
        self.store = Store(plan.data, dict(storage_options or {}))
        self.endpoints = list(endpoints or plan.recipe.vllm.endpoints)
        self.api_key = api_key
        # Local shards: hash each whole shard once (cheap, mmap). Remote: hash only the bytes of
        # each sample read, or every rank would download every shard it touches in full.
        self.verify: Verify = verify or ("shard" if self.store.is_local() else "sample")
        self._per_shard = plan.recipe.extraction.samples_per_shard
        self._train = train_set(self.store)
        self._lock = threading.Lock()  # the prefetch thread and the caller may both load
        self._rows: dict[str, pa.Table] = {}  # sample id -> its one manifest row
        self._pending: dict[str, PlannedShard] = {}  # hybrid: shards still to generate
        self._vllm_version: str | None = None
        if self.mode != "online":
            self._index_store()
        if self.mode != "offline":  # this run's requests write staging files: killed ones left some
            sweep_staging(plan)

    # -- what exists ------------------------------------------------------------------

    def _shard_of(self, sample_id: str) -> str:
        return paths.shard_id(self._train.positions[sample_id] // self._per_shard)

    def _index_store(self) -> None:
        manifest = read_manifest(self.store)
        # verify=False: sizes only here; each shard is hashed when first read (self.verify).
        rec = reconcile(self.store, self._train.expected(), self._per_shard, manifest=manifest, verify=False)
        if self.mode == "offline" and rec.to_generate:
            self.skipped = _unavailable(rec)
            allowed = self.max_missing_fraction * len(self._train.expected())
            if len(self.skipped) > allowed:
                self.skipped = {}
                raise MissingSamples(_missing_message(self.plan, rec, self.max_missing_fraction))
        present = set(rec.present)
        ids, shards = manifest["sample_id"].to_pylist(), manifest["shard_id"].to_pylist()
        for i, (sid, shard) in enumerate(zip(ids, shards, strict=True)):
            if sid in present and self._shard_of(sid) == shard:
                self._rows[sid] = manifest.slice(i, 1)  # load_sample then filters one row, not the table
        self._pending = {p.shard_id: p for p in rec.to_generate}

    def items(self) -> list[tuple[str, int]]:
        """(sample_id, num_tokens) of every train sample (but those skipped), in the prepared order;
        no tensor is read."""
        return [
            (e.sample_id, e.num_tokens) for e in self._train.expected() if e.sample_id not in self.skipped
        ]

    # -- loading ----------------------------------------------------------------------

    def load(self, sample_ids: Sequence[str]) -> list[Sample]:
        """The samples' tensors (hidden states [T, n_layers, H], token ids, loss mask), in order."""
        ids = list(sample_ids)
        unknown = [sid for sid in ids if sid not in self._train.positions]
        if unknown:
            raise KeyError(f"{len(unknown)} sample ids are not in the train split, e.g. {unknown[:3]}")
        ids = [sid for sid in ids if sid not in self.skipped]
        if self.mode == "online":
            results = run_coroutine(self._extract(ids))
            self._skip_failed({s.sample_id: s.reason for s in results if isinstance(s, FailedSample)})
            got = {s.sample_id: s for s in results if isinstance(s, Sample)}
        else:
            got = self._generate_missing(ids) if self.mode == "hybrid" else {}
            for sid in ids:
                if sid not in got and sid not in self.skipped:
                    got[sid] = self._load_stored(sid, ids, got)
        out = [got[sid] for sid in ids if sid in got]
        if ids and not out:  # nothing to train this pack on
            raise SampleUnavailable(
                f"every sample of a batch failed extraction, e.g. {ids[0]}: {self.skipped.get(ids[0])}"
            )
        return out

    def _skip_failed(self, failures: dict[str, str]) -> None:
        """Online and hybrid: train without samples whose extraction failed, as offline does,
        while they stay within training.max_missing_fraction of the train split (each process
        counts its own); past it, the run stops naming the sample and the setting."""
        if not failures:
            return
        self.skipped.update((sid, f"extraction failed: {reason}") for sid, reason in failures.items())
        allowed = self.max_missing_fraction * len(self._train.expected())
        sid, reason = next(iter(failures.items()))
        if len(self.skipped) > allowed:
            raise SampleUnavailable(
                f"sample {sid} failed extraction: {reason}; {len(self.skipped)} train samples are now "
                f"unavailable, more than training.max_missing_fraction ({self.max_missing_fraction}) of "
                f"{len(self._train.expected())} allows: raise it to train without them"
            )
        print(
            f"draftflow.train: training without sample {sid} ({reason}); {len(self.skipped)} unavailable "
            f"so far, training.max_missing_fraction allows {int(allowed)}",
            file=sys.stderr,
            flush=True,
        )

    def _load_stored(self, sid: str, ids: list[str], got: dict[str, Sample]) -> Sample:
        """One stored sample; a shard found corrupt here (a same-size bit flip that the size-only
        index could not see) is regenerated in hybrid mode, and named with its repair in offline."""
        try:
            return load_sample(self.store, self._rows[sid], sid, verify=self.verify)
        except CorruptShardError as err:
            shard = self._shard_of(sid)
            if self.mode != "hybrid":
                raise CorruptShardError(
                    f"shard {shard} of {self.plan.data.root} is corrupt ({err}); repair it with `draftflow extract "
                    f"{self.plan.recipe_path}` (re-hashes the shards and re-extracts corrupt ones), or set "
                    "extraction.mode=hybrid to regenerate it during training"
                ) from None
        with self._lock:
            planned = plan_shard(self.plan, self.store, shard, verify=True)
            if planned is None:  # another rank regenerated it meanwhile: read the new commit
                self._index_store()
                return load_sample(self.store, self._rows[sid], sid, verify=self.verify)
            self._pending[shard] = planned
            for other in [s for s, _ in self.items() if self._shard_of(s) == shard]:
                self._rows.pop(other, None)
        got.update(self._generate_missing(ids))
        return got[sid]

    def prefetch(self, batches: Iterable[Sequence[str]], depth: int = 2) -> Prefetcher:
        """Iterate over ``load(batch)`` for each batch, loading up to ``depth`` batches ahead."""
        return Prefetcher(self.load, batches, depth)

    # -- generating -------------------------------------------------------------------

    async def _extract(self, ids: list[str]) -> list[Sample | FailedSample]:
        async with make_client(self.plan, self.endpoints, self.api_key) as client:
            return await extract_samples(self._train, ids, client, dtype=self.plan.recipe.extraction.dtype)

    async def _extract_shards(self, shards: list[PlannedShard]) -> list[ShardResult]:
        async with make_client(self.plan, self.endpoints, self.api_key) as client:
            if self._vllm_version is None:
                self._vllm_version = await client.version()
            return [
                await extract_shard(
                    self.plan,
                    self.store,
                    shard,
                    client,
                    mode="online",
                    vllm_version=self._vllm_version,
                    train=self._train,
                    return_samples=True,
                )
                for shard in shards  # each shard already spreads its samples over every endpoint
            ]

    def _generate_missing(self, ids: list[str]) -> dict[str, Sample]:
        """Hybrid: generate and commit the shards holding ``ids`` not in the store; their samples."""
        with self._lock:
            shards = sorted({self._shard_of(sid) for sid in ids if sid not in self._rows})
            if not shards:
                return {}
            results = run_coroutine(self._extract_shards([self._pending[s] for s in shards]))
            got: dict[str, Sample] = {}
            failed: dict[str, str] = {}
            for result in results:
                # Index the new commit from its own fragment: re-reading the whole manifest per
                # generated shard would cost a listing and every fragment, each time.
                fragment = from_ipc_bytes(self.store.read_all(result.fragment_url))
                statuses = zip(fragment["sample_id"].to_pylist(), fragment["status"].to_pylist(), strict=True)
                for i, (sid, status) in enumerate(statuses):
                    if status == STATUS_OK:
                        self._rows[sid] = fragment.slice(i, 1)
                got.update((s.sample_id, s) for s in result.samples)
                failed.update(result.failures)
                del self._pending[result.shard_id]
        # A failed sample's shard is committed (the others load next time); the sample is skipped.
        self._skip_failed({sid: failed[sid] for sid in ids if sid in failed})
        return got


def _unavailable(rec: Reconciliation) -> dict[str, str]:
    """Sample id -> why it cannot be loaded from the store."""
    out = {sid: "missing from the store" for sid in rec.missing}
    out.update((sid, f"extraction failed: {reason}") for sid, reason in rec.failed)
    out.update((sid, "in a broken shard") for sid in rec.corrupt)
    return out


def _missing_message(plan: Plan, rec: Reconciliation, max_missing_fraction: float = 0.0) -> str:
    shards = [p.shard_id for p in rec.to_generate]
    named = ", ".join(f"{p.shard_id} ({'; '.join(p.reasons)})" for p in rec.to_generate[:_SHARDS_NAMED])
    more = f" and {len(shards) - _SHARDS_NAMED} more" if len(shards) > _SHARDS_NAMED else ""
    total = len(rec.present) + len(rec.missing) + len(rec.failed) + len(rec.corrupt)
    return (
        f"extraction.mode=offline but {total - len(rec.present)} of {total} train samples are not in "
        f"{plan.data.root} ({len(rec.missing)} missing, {len(rec.failed)} failed, {len(rec.corrupt)} in "
        f"broken shards); {len(shards)} shards to (re)generate: {named}{more}. Run `draftflow extract "
        f"{plan.recipe_path}` first, set extraction.mode=hybrid to generate them during training, or "
        f"raise training.max_missing_fraction (now {max_missing_fraction}) to at least "
        f"{(total - len(rec.present)) / max(total, 1):.4g} to train without them"
    )


class Prefetcher:
    """Runs ``load`` over batches in a background thread, ``depth`` batches ahead.

    ``wait_s`` accumulates the time the consumer waited for a batch: near zero when loading
    keeps up with training. Errors in the thread are raised in the consumer. Closing (or
    dropping) the iterator stops the thread after its current batch.
    """

    _END = object()

    def __init__(
        self, load: Callable[[list[str]], list[Sample]], batches: Iterable[Sequence[str]], depth: int = 2
    ):
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(load, batches), name="draftflow-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, load: Callable[[list[str]], list[Sample]], batches: Iterable[Sequence[str]]) -> None:
        try:
            for batch in batches:
                if self._stop.is_set() or not self._put(load(list(batch))):
                    return
            self._put(self._END)
        except BaseException as err:  # surfaces in the consumer, not lost in the thread
            self._put(err)

    def __iter__(self) -> Iterator[list[Sample]]:
        try:
            while True:
                started = time.perf_counter()
                item = self._queue.get()
                self.wait_s += time.perf_counter() - started
                if item is self._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def open_source(plan: Plan, **kwargs) -> SampleSource:
    """The trainer's source; storage options and API key come from the environment unless given
    (:mod:`draftflow.process_env`: torchrun workers must not carry secrets on their command line)."""
    kwargs.setdefault("storage_options", storage_options_from_env())
    kwargs.setdefault("api_key", vllm_api_key_from_env())
    return SampleSource(plan, **kwargs)
