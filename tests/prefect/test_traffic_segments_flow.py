"""Two traffic windows through the extract flow (real vLLM, real Prefect server): the second run
prepares and extracts only the conversations logged since the first, never rewrites the first
segment, and no planted secret reaches the store, the run's results or its artifacts."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect_helpers import recipe_dict

from draftflow.data.segments import list_segments
from draftflow.paths import DataLayout
from draftflow.run_ref import RunRef
from draftflow.store import Store, read_manifest, verify

pytestmark = pytest.mark.slow

# Planted in logged requests and replies; none may be stored anywhere.
SECRETS = ("ops.lead@example.org", "sk-proj-PLANTEDkey0123456789abcdefXYZ", "4012 8888 8888 1881")
TOPICS = ("rivers", "bread", "chess", "volcanoes", "kites", "owls", "tides", "glass", "maps", "bees")


def exchange(at: datetime, n: int, window: int) -> dict:
    topic = TOPICS[n % len(TOPICS)]
    question = f"Window {window}, question {n}: tell me one fact about {topic}."
    answer = f"Here is a fact about {topic}: it is a fine subject for question {n} of window {window}."
    if n == 1:
        question += f" Reply to {SECRETS[0]} using key {SECRETS[1]}."
    if n == 2:
        answer += f" Your card {SECRETS[2]} was charged."
    return {
        "timestamp": at.isoformat(),
        "request": {"model": "smollm2", "messages": [{"role": "user", "content": question}]},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]},
    }


def write_log(path: Path, lines: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def test_a_second_window_prepares_and_extracts_only_new_traffic(
    prefect_server, extraction_endpoint, staging_dir, smollm2_dir: Path, tmp_path: Path
):
    from flows.stages import extract

    logs = tmp_path / "logs"
    before = datetime.now(UTC) - timedelta(hours=1)
    first = [exchange(before + timedelta(seconds=n), n, 1) for n in range(14)]
    write_log(logs / "day1.jsonl", [*first, "{cut off", {"request": {"messages": []}}])
    time.sleep(1.2)  # windows end on a whole second: day1.jsonl is then older than the first one's end

    recipe = recipe_dict(smollm2_dir, str(tmp_path / "store"), extraction_endpoint, str(staging_dir))
    recipe["name"] = "traffic-segments"
    recipe["data"] = {
        "sources": [{"kind": "traffic", "traffic": {"paths": [str(logs / "*.jsonl")]}}],
        "eval_samples": 2,
        "max_length": 128,
        "seed": 3,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    assert extract(str(path)).failed == 0
    (one,) = list_segments(str(tmp_path / "store"), "traffic-segments")
    assert one["window"]["since"] is None
    assert one["counts"]["kept"] == 14 and one["counts"]["malformed"] == 1 and one["counts"]["redacted"] == 2
    first_root = Path(tmp_path / "store" / one["folder"])
    first_files = {p: p.stat().st_mtime_ns for p in first_root.rglob("*") if p.is_file()}

    # Window 2: six new exchanges, and four of window 1 asked again (kept once, by window 1).
    now = datetime.now(UTC)
    again = [{**line, "timestamp": now.isoformat()} for line in first[3:7]]
    write_log(logs / "day2.jsonl", [*(exchange(now, n, 2) for n in range(6)), *again])
    time.sleep(1.2)  # the second run's window ends at its start, to the second: after these lines

    assert extract(str(path)).failed == 0
    one_again, two = list_segments(str(tmp_path / "store"), "traffic-segments")
    assert one_again == one
    assert two["window"]["since"] == one["window"]["until"]  # since: last_run
    assert two["counts"]["kept"] == 6 and two["counts"]["duplicates"] == 4
    assert two["counts"]["outside_window"] == 0  # day1.jsonl was last written before the window
    assert {p: p.stat().st_mtime_ns for p in first_root.rglob("*") if p.is_file()} == first_files

    # The second segment's folder holds exactly its new conversations, extracted and verified.
    _, plan = RunRef.create(str(path), [], segment="new")  # a third run would start where the second ended
    assert plan.window.since == datetime.fromisoformat(two["window"]["until"])
    _, plan = RunRef.create(str(path), [])  # training, evaluation, publishing: the newest segment
    assert plan.window.as_dict() == two["window"] and plan.data.root.endswith(two["folder"])
    second_root = tmp_path / "store" / two["folder"]
    samples = pq.read_table(second_root / "prepared" / "samples.parquet")
    texts = [json.loads(m)[0]["content"] for m in samples["messages"].to_pylist()]
    assert sorted(t.split(":")[0] for t in texts) == [f"Window 2, question {n}" for n in range(6)]
    store = Store(DataLayout(str(second_root)))
    manifest = read_manifest(store)
    train_ids = [
        i for i, s in zip(samples["sample_id"].to_pylist(), samples["split"].to_pylist()) if s == "train"
    ]
    assert sorted(manifest["sample_id"].to_pylist()) == sorted(train_ids) and verify(store).ok

    # No planted secret anywhere: the store's files, the samples' text, Prefect's persisted results
    # and the runs' artifacts.
    stored_text = " ".join(
        m
        for root in (first_root, second_root)
        for m in pq.read_table(root / "prepared" / "samples.parquet")["messages"].to_pylist()
    )
    places = [tmp_path / "store", Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"])]
    blobs = [p.read_bytes() for place in places if place.exists() for p in place.rglob("*") if p.is_file()]
    with get_client(sync_client=True) as client:
        artifacts = json.dumps([a.model_dump(mode="json") for a in client.read_artifacts()])
    for secret in SECRETS:
        assert secret not in stored_text and secret not in artifacts
        assert not [b for b in blobs if secret.encode() in b]
    assert "[EMAIL]" in stored_text and "[API_KEY]" in stored_text and "[CARD]" in stored_text
