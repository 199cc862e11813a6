"""Faults of the real server that one sample or one request meets, through a fault-injecting proxy.

A 5xx that one sample gets every time costs that sample only (it is retried alone, recorded as
failed, and the rest of its shard is committed), and a request retried after a client timeout
leaves no staging file behind (the server wrote one for each attempt). See fault_proxy.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from extraction_helpers import plant_stale_staging_file, recipe_dict
from fault_proxy import FaultProxy

from draftflow.data.prepare import prepare_recipe
from draftflow.extraction import expected_samples, extract_shard_by_id
from draftflow.extraction.samples import train_set
from draftflow.plan import Plan
from draftflow.store import Store, read_manifest

pytestmark = pytest.mark.slow


def prepared_recipe(tmp_path: Path, smollm2_dir: Path, endpoint: str, staging: Path, **extraction) -> Plan:
    data = recipe_dict(smollm2_dir, str(tmp_path / "store"), endpoint, str(staging))
    data["extraction"].update(extraction)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    plan = Plan.load(str(path))
    prepare_recipe(plan.recipe, plan.data)
    return plan


def completion_prompt(path: str, body: dict | None) -> list[int] | None:
    return body.get("prompt") if path == "/v1/completions" and body else None


def test_a_sample_the_server_fails_every_time_costs_only_that_sample(
    extraction_server, smollm2_dir: Path, staging_dir: Path, tmp_path: Path
):
    poisoned: list[list[int]] = []

    def rule(path, body, count):
        return ("status", 500) if completion_prompt(path, body) in poisoned else None

    with FaultProxy(extraction_server.url, rule) as proxy:
        plan = prepared_recipe(tmp_path, smollm2_dir, proxy.url, staging_dir, request_retries=1)
        store = Store(plan.data)
        ids = [e.sample_id for e in expected_samples(plan, store)][:4]  # shard 000000
        bad = ids[1]
        poisoned.append(train_set(store).tokens(bad)[0].tolist())
        result = extract_shard_by_id(plan, "000000", [proxy.url])
        seen = {
            json.loads(body)["prompt"].__repr__(): n
            for (path, body), n in proxy.seen.items()
            if body != "null"
        }
    assert result.samples_ok == 3 and result.samples_failed == 1, result
    [(failed_id, reason)] = result.failures
    assert failed_id == bad and "server error on every attempt, alone too: HTTP 500" in reason
    rows = read_manifest(store).to_pylist()
    assert sorted(r["sample_id"] for r in rows if r["status"] == "ok") == sorted(i for i in ids if i != bad)
    assert [r["sample_id"] for r in rows if r["status"] != "ok"] == [bad]  # recorded, retried next run
    tokens = train_set(store)
    for sid in ids:
        asked = seen[repr(tokens.tokens(sid)[0].tolist())]
        # the good ones once; the bad one 1 + 1 retry, then alone 1 + 1 retry (not 4 whole shards)
        assert asked == (4 if sid == bad else 1), (sid, asked)
    assert list(staging_dir.iterdir()) == []


def test_a_request_retried_after_a_timeout_leaves_no_staging_file(
    extraction_server, smollm2_dir: Path, staging_dir: Path, tmp_path: Path
):
    """The server answers every first attempt late (after the client's timeout) but did the work,
    writing a hidden-state file the client never hears of; the retry succeeds."""

    def rule(path, body, count):
        return ("delay", 8.0) if completion_prompt(path, body) is not None and count == 1 else None

    with FaultProxy(extraction_server.url, rule) as proxy:
        plan = prepared_recipe(
            tmp_path, smollm2_dir, proxy.url, staging_dir, request_retries=3, request_timeout_s=3.0
        )
        result = extract_shard_by_id(plan, "000000", [proxy.url])
        assert result.samples_ok == 4 and result.samples_failed == 0, result
        attempts = [n for (path, body), n in proxy.seen.items() if path == "/v1/completions"]
        assert len(attempts) == 4 and min(attempts) >= 2, attempts  # every sample was retried
    assert list(staging_dir.iterdir()) == []


@pytest.mark.parametrize("mode", ["online", "hybrid"])
def test_online_and_hybrid_train_without_failed_samples_within_max_missing_fraction(
    extraction_server, smollm2_dir: Path, staging_dir: Path, tmp_path: Path, mode: str
):
    """A sample the server rejects (HTTP 400) is left out, as offline mode leaves out missing
    ones, while training.max_missing_fraction allows it; past it, the run stops naming both."""
    from draftflow.sample_source import SampleSource, SampleUnavailable

    rejected: list[list[int]] = []

    def rule(path, body, count):
        return ("status", 400) if completion_prompt(path, body) in rejected else None

    with FaultProxy(extraction_server.url, rule) as proxy:
        plan = prepared_recipe(tmp_path, smollm2_dir, proxy.url, staging_dir, request_retries=0)
        store = Store(plan.data)
        ids = [e.sample_id for e in expected_samples(plan, store)][:4]
        rejected.append(train_set(store).tokens(ids[2])[0].tolist())
        left = plant_stale_staging_file(staging_dir)  # by a client killed mid-request, long ago
        source = SampleSource(plan, mode=mode, endpoints=[proxy.url], max_missing_fraction=0.1)
        assert not left.exists()  # an online or hybrid trainer sweeps too, not only the CLI
        got = source.load(ids)
        assert [s.sample_id for s in got] == [ids[0], ids[1], ids[3]]
        assert list(source.skipped) == [ids[2]] and "HTTP 400" in source.skipped[ids[2]]
        assert [s.sample_id for s in source.load(ids)] == [ids[0], ids[1], ids[3]]  # not asked again
        strict = SampleSource(plan, mode=mode, endpoints=[proxy.url], max_missing_fraction=0.0)
        with pytest.raises(SampleUnavailable, match=r"training.max_missing_fraction \(0.0\)"):
            strict.load(ids)
    assert list(staging_dir.iterdir()) == []
