"""The extraction stage: prepared train samples -> target hidden states (vLLM) -> committed shards.

From smallest to largest:

* :mod:`~draftflow.extraction.samples` — :class:`TrainSet`, the prepared train split in its
  stored order (pinned by the recipe fingerprint, so shard ``k`` always holds the same
  samples), and the plans: :func:`plan_extraction` (every shard) and :func:`plan_shard` (one).
* :mod:`~draftflow.extraction.shards` — :func:`extract_samples` (hidden states through a
  :class:`~draftflow.vllm.client.VLLMClient`, cast to the recipe dtype, rejected samples
  recorded as failures), :func:`extract_shard` (one planned shard, committed with
  ``write_shard``) and :func:`extract_shard_by_id` (the same from a plan, a shard id and endpoint
  URLs — the body of a Prefect shard task).
* :mod:`~draftflow.extraction.run` — :func:`run_extraction`, the whole stage in one process:
  check or start the servers, prepare the data if needed (regenerating replies through the
  same servers), reconcile, and extract only the missing, failed or corrupt shards;
  :func:`prepare_data` is the preparation step alone (a flow's task before the shard tasks).
* :mod:`~draftflow.extraction.faults` — test-only fault hooks (``DRAFTFLOW_TEST_FAIL_SHARDS``,
  ``DRAFTFLOW_TEST_HOLD_SHARDS``).
"""

from draftflow.extraction.faults import FAULT_ONCE_DIR_ENV, FAULT_SHARDS_ENV, InjectedFault
from draftflow.extraction.progress import ExtractionProgress, ExtractionSummary
from draftflow.extraction.run import prepare_data, run_extraction
from draftflow.extraction.samples import TrainSet, expected_samples, plan_extraction, plan_shard, train_set
from draftflow.extraction.shards import (
    ShardResult,
    extract_samples,
    extract_shard,
    extract_shard_by_id,
    extraction_info,
    make_client,
    sample_failure,
    sweep_staging,
)

__all__ = [
    "FAULT_ONCE_DIR_ENV",
    "FAULT_SHARDS_ENV",
    "ExtractionProgress",
    "ExtractionSummary",
    "InjectedFault",
    "ShardResult",
    "TrainSet",
    "expected_samples",
    "extract_samples",
    "extract_shard",
    "extract_shard_by_id",
    "extraction_info",
    "make_client",
    "plan_extraction",
    "plan_shard",
    "sweep_staging",
    "prepare_data",
    "run_extraction",
    "sample_failure",
    "train_set",
]
