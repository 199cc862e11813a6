"""Continual refresh end to end on the CPU stack: three traffic windows through the pipeline flow
(real Prefect, vLLM extraction and evaluation, torchrun training), then a rollback served by vLLM.

1. Window 1, nothing in service: trained from scratch, judged by the usual gate (τ only: its speed
   is not measured, as a refresh recipe may say), published.
2. Window 2: warm-started from the drafter in service with a replayed share of window 1, raced
   beside it; the margins are set so that it is published whatever the race says (the race's
   figures are recorded either way).
3. Window 3: a worse challenger (trained from scratch for a few steps at a tiny learning rate) is
   raced against the drafter in service and refused: the release pointer does not move, and the
   history says why, with both drafters' τ and speed-up and the window's counts.
Then `releases rollback` restores window 1's drafter, and vLLM serves the folder `current` names.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import yaml
from prefect.client.orchestration import get_client

from draftflow.data.prepare import sample_id
from draftflow.data.segments import list_segments
from draftflow.data.sources import load_source
from draftflow.paths import DataLayout
from draftflow.recipe.schema import DataSource
from draftflow.releases import Releases
from draftflow.store.backend import Store
from draftflow.store.manifest import read_manifest
from draftflow.vllm.launch import free_port

pytestmark = pytest.mark.slow
SECRETS = ("dana.ops@example.net", "hf_PLANTEDtoken0123456789abcdefghijkl")


def manifest_ids(store: str, fingerprint: str) -> set[str]:
    """The sample ids a segment's extracted shards hold."""
    layout = DataLayout.for_recipe(store, "refresh-e2e", fingerprint)
    return set(read_manifest(Store(layout))["sample_id"].to_pylist())


def log_window(path: Path, conversations: list, at: datetime) -> None:
    lines = []
    for n, conversation in enumerate(conversations):
        request = {"model": "smollm2", "messages": conversation[:-1]}
        reply = {"choices": [{"message": conversation[-1]}]}
        when = (at + timedelta(milliseconds=n)).isoformat()
        lines.append(json.dumps({"timestamp": when, "request": request, "response": reply}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow_ok(
    reason="three pipeline runs (extraction, torchrun, evaluation racing up to three vLLM servers) and "
    "one more server for the rollback: the refresh loop's Done-when, end to end"
)
def test_three_refresh_windows_then_a_rollback_that_vllm_serves(
    smollm2_dir, prefect_harness, vllm_servers, vllm_python, tmp_path
):
    from flows.pipeline import pipeline

    vllm_servers.stop()  # the pipeline launches its own servers under the CPU host's lock
    chats, _ = load_source(DataSource(kind="chatterbot"))
    distinct = list({sample_id(c): c for c in chats}.values())
    windows = [distinct[0:40], distinct[40:80], distinct[80:120]]
    windows[0][0] = [  # planted: no file of the store, the runs or the releases may hold them
        {"role": "user", "content": f"Write to {SECRETS[0]} and use the key {SECRETS[1]}, please."},
        {"role": "assistant", "content": "Done: I wrote to them with that key."},
    ]
    logs, dest = tmp_path / "logs", tmp_path / "published"
    recipe = {
        "name": "refresh-e2e",
        "target": {"model": str(smollm2_dir)},
        "data": {
            "sources": [{"kind": "traffic", "traffic": {"paths": [str(logs / "*.jsonl")]}}],
            "eval_samples": 4,
            "max_length": 96,
        },
        "extraction": {"dtype": "float32", "store": str(tmp_path / "store"), "samples_per_shard": 8},
        "vllm": {
            "endpoints": [f"http://127.0.0.1:{free_port()}"],
            "launch": {"python": vllm_python, "device": "cpu", "max_model_len": 1024},
        },
        "drafter": {
            "kind": "dflash",
            "block_size": 4,
            "max_anchors": 16,
            "num_layers": 1,
            "draft_vocab_size": 2048,
        },
        "training": {
            "epochs": 8,
            "lr": 3.0e-3,
            "pack_length": 256,
            "device": "cpu",
            "log_every": 5,
            "validation_fraction": 0.0,
            "run_dir": str(tmp_path / "runs"),
        },
        "evaluation": {
            "prompt_set": "held_out",
            "num_prompts": 4,
            "max_new_tokens": 24,
            "min_acceptance_length": 1.0,
            "min_speedup": None,
        },
        "publish": {"destination": str(dest)},
        "refresh": {"epochs": 2, "replay": 0.5, "min_gain_acceptance": -10, "min_gain_speedup": -10},
    }
    path = tmp_path / "refresh.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    releases = Releases(str(dest), "refresh-e2e")

    def run(window: int, *overrides: str):
        log_window(logs / f"window-{window}.jsonl", windows[window - 1], datetime.now(UTC))
        time.sleep(1.2)  # the run's window ends at its start, to the second: after these lines
        started = time.monotonic()
        result = pipeline(recipe=str(path), overrides=list(overrides))
        print(f"window {window}: pipeline {time.monotonic() - started:.0f} s; {result.summary()}")
        return result

    first = run(1, "evaluation.measure_speedup=false")  # nothing in service to race: no target-alone pass
    assert first.published and first.warm_start is None and first.replayed_samples == 0
    v1 = releases.current().version
    kept = releases.history()[-1]["details"]["counts"]["kept"]
    assert 36 <= kept <= 40  # a conversation too long for the template's budget may be dropped
    assert releases.history()[-1]["details"]["counts"]["redacted"] == 1

    second = run(2)
    v2 = releases.current().version
    assert second.published and v2 != v1 and second.warm_start is not None
    assert second.warm_start.rstrip("/").endswith(f"refresh-e2e-{v1}")
    segments = list_segments(str(tmp_path / "store"), "refresh-e2e")
    assert len(segments) == 2 and segments[0]["counts"]["kept"] == kept
    # Window 2 read and prepared its own 40 conversations and extracted their train samples (4 of
    # them held out), none of window 1's.
    store = str(tmp_path / "store")
    ids = [manifest_ids(store, segment["fingerprint"]) for segment in segments]
    assert segments[1]["counts"]["lines"] == 40 and 36 <= segments[1]["counts"]["kept"] <= 40
    assert len(ids[1]) == segments[1]["counts"]["kept"] - 4 and not ids[0] & ids[1]
    assert second.replayed_samples == (kept - 4) // 2  # half of window 1's train samples
    line = releases.history()[-1]
    assert line["event"] == "published" and line["details"]["champion"]["version"] == v1
    assert line["details"]["window"]["since"] == segments[0]["window"]["until"]

    worse = ["refresh.warm_start=false", "refresh.replay=0.0", "training.epochs=1", "training.lr=1.0e-9"]
    worse += ["refresh.min_gain_acceptance=0.0", "refresh.min_gain_speedup=-10"]
    third = run(3, *worse)
    assert third.published is None and third.kept == v2 and third.warm_start is None
    assert releases.current().version == v2
    refused = releases.history()[-1]
    assert refused["event"] == "refused" and refused["previous"] == v2
    details = refused["details"]
    assert details["tau"] < details["champion"]["tau"] and "does not beat the champion's" in details["reason"]
    assert details["counts"]["lines"] == 40 and "speedup" in details and "speedup" in details["champion"]

    back = releases.rollback(v1)
    assert releases.current().version == v1 and back.previous == v2
    server = vllm_servers.get(Path(releases.current().url))  # `vllm serve $(draftflow releases current …)`
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": server.spec.model,
            "prompt": "Hello, how are you?",
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0, "the rolled-back drafter drafted"
    vllm_servers.stop()

    files = [
        p for place in ("store", "runs", "published") for p in (tmp_path / place).rglob("*") if p.is_file()
    ]
    assert not [p for p in files for secret in SECRETS if secret.encode() in p.read_bytes()]
    with get_client(sync_client=True) as client:
        artifacts = json.dumps([a.model_dump(mode="json") for a in client.read_artifacts()])
    assert not [secret for secret in SECRETS if secret in artifacts]
