"""Extraction pieces that need no vLLM server: id safety, planning, failure classes, fault hook,
prefetching, CLI helpers."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from draftflow.cli import main as cli_main
from draftflow.cli.extract import ProgressBar
from draftflow.cli.store import infer_samples_per_shard
from draftflow.data.dataset import TOKEN_COUNTS_SCHEMA, atomic_write, samples_table, write_parquet
from draftflow.extraction import (
    FAULT_ONCE_DIR_ENV,
    FAULT_SHARDS_ENV,
    ExtractionProgress,
    InjectedFault,
    TrainSet,
    plan_shard,
    sample_failure,
)
from draftflow.extraction.faults import injected_fault
from draftflow.paths import DataLayout
from draftflow.plan import Plan
from draftflow.recipe.load import RecipeError
from draftflow.sample_source import Prefetcher
from draftflow.store import Store, read_manifest
from draftflow.vllm.client import EndpointUnavailable, InvalidHiddenStates, RequestFailed


def write_prepared(root: str, sample_ids: list[str]) -> None:
    """A minimal complete prepared folder whose train split has these ids (3 tokens each)."""
    layout = DataLayout(root)
    n = len(sample_ids)
    rows = {
        "sample_id": sample_ids,
        "split": ["train"] * n,
        "input_ids": [np.array([1, 2, 3], dtype=np.int32)] * n,
        "loss_mask": [np.array([0, 1, 1], dtype=np.uint8)] * n,
        "num_tokens": [3] * n,
        "num_loss_tokens": [2] * n,
        "source": ["test"] * n,
        "messages": ["[]"] * n,
    }
    write_parquet(layout.samples, samples_table(rows), None)
    write_parquet(layout.token_counts, TOKEN_COUNTS_SCHEMA.empty_table(), None)
    atomic_write(layout.prepare_report, None, lambda f: f.write(b"{}"))


@pytest.mark.parametrize("crafted", ["../../etc/passwd", "a/b", ".hidden", "x" * 200])
def test_crafted_sample_id_is_rejected_before_any_request(tmp_path: Path, crafted: str, capsys):
    root = str(tmp_path / "data")
    write_prepared(root, ["0123456789abcdef", crafted])
    with pytest.raises(ValueError, match="unsafe path component"):
        TrainSet.load(Store.at(root))
    assert cli_main(["store", "reconcile", root, "--samples-per-shard", "4"]) == 2
    assert "unsafe path component" in capsys.readouterr().err


def test_train_set_keeps_stored_order(tmp_path: Path):
    root = str(tmp_path / "data")
    ids = [f"s{i:03d}" for i in range(7)]
    write_prepared(root, ids)
    train = TrainSet.load(Store.at(root))
    assert [e.sample_id for e in train.expected()] == ids and train.expected()[0].num_tokens == 3
    tokens, mask = train.tokens("s004")
    assert tokens.dtype == np.int32 and tokens.tolist() == [1, 2, 3] and mask.tolist() == [0, 1, 1]


@pytest.fixture
def tiny_plan(tmp_path: Path, tiny_llama_dir: Path) -> Plan:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "name": "parts",
                "target": {"model": str(tiny_llama_dir)},
                "data": {"sources": [{"kind": "chatterbot"}], "max_length": 64},
                "extraction": {"store": str(tmp_path / "store"), "samples_per_shard": 3, "layer_ids": [1, 4]},
                "drafter": {"kind": "dflash"},
            }
        )
    )
    plan = Plan.load(str(recipe))
    write_prepared(plan.data.root, [f"s{i:03d}" for i in range(7)])  # 3 shards: 3 + 3 + 1
    return plan


@pytest.mark.parametrize("bad", ["../000001", "1", "000001/x", "shard-00001", "000003"])
def test_plan_shard_rejects_ids_that_are_not_shards_of_this_data(tiny_plan: Plan, bad: str):
    with pytest.raises(ValueError, match="not a shard id|does not exist"):
        plan_shard(tiny_plan, Store(tiny_plan.data), bad)


def test_plan_shard_plans_the_slice_of_the_stable_order(tiny_plan: Plan):
    planned = plan_shard(tiny_plan, Store(tiny_plan.data), "000002")
    assert (planned.sample_ids, planned.attempt, planned.reasons) == (("s006",), 1, ("1 missing",))
    assert plan_shard(tiny_plan, Store(tiny_plan.data), "000001").sample_ids == ("s003", "s004", "s005")


def test_sample_failures_versus_server_failures():
    assert "invalid hidden states: token_ids differ" == sample_failure(
        InvalidHiddenStates("token_ids differ", "/x")
    )
    assert "HTTP 400" in sample_failure(RequestFailed("http://h", 400, "prompt too long"))
    for err in (
        RequestFailed("http://h", 401, "no key"),
        RequestFailed("http://h", 503, "busy"),
        EndpointUnavailable("refused"),
    ):
        assert sample_failure(err) is None  # the server's fault: the shard fails, no sample is marked


def test_fault_hook_fires_for_listed_shards_and_once_with_a_marker_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv(FAULT_SHARDS_ENV, "000001, 000003")
    injected_fault("000002")
    for _ in range(2):
        with pytest.raises(InjectedFault, match="000003"):
            injected_fault("000003")
    monkeypatch.setenv(FAULT_ONCE_DIR_ENV, str(tmp_path / "faults"))
    with pytest.raises(InjectedFault):
        injected_fault("000001")
    injected_fault("000001")  # the marker file says it already failed once
    assert (tmp_path / "faults" / "000001").exists()


def test_prefetcher_keeps_order_bounds_lookahead_and_raises_errors():
    loaded: list[str] = []

    def load(ids):
        loaded.append(ids[0])
        if ids[0] == "bad":
            raise KeyError("no such sample")
        return [f"sample-{i}" for i in ids]

    prefetcher = Prefetcher(load, [[str(i)] for i in range(6)], depth=2)
    time.sleep(0.3)
    assert len(loaded) <= 3  # two queued + one waiting to be queued, never the whole epoch
    assert [b[0] for b in prefetcher] == [f"sample-{i}" for i in range(6)]
    assert prefetcher.wait_s >= 0

    with pytest.raises(KeyError, match="no such sample"):
        list(Prefetcher(load, [["1"], ["bad"], ["3"]]))


def test_prefetcher_stops_its_thread_when_closed_early():
    started = threading.Event()

    def endless():
        i = 0
        while True:
            started.set()
            yield [str(i)]
            i += 1

    prefetcher = Prefetcher(lambda ids: ids, endless(), depth=1)
    iterator = iter(prefetcher)
    assert next(iterator) == ["0"]
    iterator.close()
    assert not prefetcher._thread.is_alive()


def fragment_table(shards: dict[str, list[str]]) -> pa.Table:
    rows = [(shard, sid) for shard, ids in shards.items() for sid in ids]
    return pa.table({"shard_id": [r[0] for r in rows], "sample_id": [r[1] for r in rows]})


def test_samples_per_shard_is_inferred_only_when_consistent():
    expected = [f"s{i}" for i in range(10)]
    assert (
        infer_samples_per_shard(fragment_table({"000000": expected[:4], "000002": expected[8:]}), expected)
        == 4
    )
    with pytest.raises(RecipeError, match="cannot infer"):
        infer_samples_per_shard(fragment_table({"000001": expected[4:7]}), expected)  # not positions 3..5
    with pytest.raises(RecipeError, match="manifest is empty"):
        infer_samples_per_shard(read_manifest(Store.at("/nonexistent")), expected)


def test_progress_bar_in_a_log_prints_one_line_per_stage_and_shard():
    stream = io.StringIO()
    bar = ProgressBar(stream)
    event = dict(
        samples_total=16, samples_planned=8, samples_done=4, tokens_done=400, shards_planned=2, extract_s=2.0
    )
    bar(ExtractionProgress("reconcile", "stage", "reconciling /x", **event))
    bar(ExtractionProgress("extract", "sample", "", **event))  # not a terminal: no redraws
    bar(
        ExtractionProgress(
            "extract", "shard", "shard 000001 committed", samples_failed=1, shards_done=1, **event
        )
    )
    assert stream.getvalue().splitlines() == [
        "reconcile: reconciling /x",
        "[############------------] 4/8 samples, shards 1/2, 200 tokens/s, 1 failed  shard 000001 committed",
    ]


def test_sweep_removes_only_old_unlocked_staging_files(tmp_path: Path):
    """What a killed client leaves in the staging folder is removed by a later run, and nothing else."""
    import fcntl
    import os

    from draftflow.vllm.hidden_states_file import sweep_stale

    now = time.time()
    for name, age in (("old", 1000), ("young", 10), ("writing", 1000), ("nolock", 1000)):
        path = tmp_path / f"cmpl-{name}-0-abcd1234.safetensors"
        path.write_bytes(b"x")
        if name != "nolock":
            (tmp_path / f"{path.name}.lock").write_bytes(b"")
        os.utime(path, (now - age, now - age))
    held = os.open(tmp_path / "cmpl-writing-0-abcd1234.safetensors.lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # the server is still writing this one
    try:
        assert sweep_stale(str(tmp_path), 600, now=now) == 2
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cmpl-writing-0-abcd1234.safetensors",
        "cmpl-writing-0-abcd1234.safetensors.lock",
        "cmpl-young-0-abcd1234.safetensors",
        "cmpl-young-0-abcd1234.safetensors.lock",
    ]
