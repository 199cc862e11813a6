"""The hidden-state store: shards of target hidden states, indexed by an Arrow manifest.

Everything lives under one fingerprinted data folder (:class:`draftflow.paths.DataLayout`) on
any fsspec backend — a local disk, ``/dev/shm``, S3:

* :mod:`~draftflow.store.shard` — the shard format (safetensors, one contiguous byte range
  per sample) and why;
* :mod:`~draftflow.store.fp8` — FP8 hidden states (``extraction.dtype: float8_e4m3`` /
  ``float8_e5m2``): per-row scales, quantised on write, decoded vectorised on read;
* :mod:`~draftflow.store.writer` — the lock-free commit protocol (shard object first, then an
  immutable manifest fragment) and garbage collection of uncommitted objects;
* :mod:`~draftflow.store.manifest` — the manifest table, how duplicate commits resolve,
  compaction, ``ls``;
* :mod:`~draftflow.store.reader` — loading one sample or a whole shard, checksum verification;
* :mod:`~draftflow.store.reconcile` — what is present, missing, failed or corrupt, and which
  shards to (re)generate.
"""

from draftflow.store.backend import Store
from draftflow.store.manifest import ExtractionInfo, StoreSummary, compact, ls, read_manifest
from draftflow.store.reader import (
    BadShard,
    CorruptShardError,
    VerifyReport,
    forget_verified,
    iter_shard,
    load_sample,
    verify,
)
from draftflow.store.reconcile import ExpectedSample, PlannedShard, Reconciliation, reconcile
from draftflow.store.shard import Sample
from draftflow.store.writer import CommittedShard, CommitTooLate, FailedSample, GcReport, gc, write_shard

__all__ = [
    "BadShard",
    "CommitTooLate",
    "CommittedShard",
    "CorruptShardError",
    "ExpectedSample",
    "ExtractionInfo",
    "FailedSample",
    "GcReport",
    "PlannedShard",
    "Reconciliation",
    "Sample",
    "Store",
    "StoreSummary",
    "VerifyReport",
    "compact",
    "forget_verified",
    "gc",
    "iter_shard",
    "load_sample",
    "ls",
    "read_manifest",
    "reconcile",
    "verify",
    "write_shard",
]
