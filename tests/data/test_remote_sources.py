"""Sources on S3 (moto on loopback): their listing (keys, sizes, ETags) is in the fingerprint, so
an edited object names a new data folder instead of reusing the old preparation, and they are
read with the store's storage options, with no AWS credentials in the environment."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
from test_storage_credentials import no_credentials  # noqa: F401 (the fixture: no AWS credentials anywhere)

from draftflow.data.dataset import TRAIN, load_prepared
from draftflow.data.prepare import prepare_recipe
from draftflow.paths import DataLayout
from draftflow.plan import Plan
from draftflow.process_env import STORAGE_OPTIONS_ENV
from draftflow.recipe.fingerprint import fingerprint
from draftflow.recipe.load import RecipeError, load_recipe

LAYER_IDS = [1, 4]


def _records(answer: str, n: int = 6) -> bytes:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}?"},
                {"role": "assistant", "content": answer},
            ]
        }
        for i in range(n)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _recipe(tmp_path: Path, model: Path, source: str, store: str) -> str:
    path = tmp_path / "recipe.yaml"
    data = {
        "name": "remote-source",
        "target": {"model": str(model)},
        "data": {"sources": [{"kind": "messages", "path": source}], "eval_samples": 1, "max_length": 64},
        "extraction": {"store": store, "layer_ids": LAYER_IDS},
        "drafter": {"kind": "dflash"},
    }
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.slow
def test_edited_s3_source_names_a_new_data_folder(s3, tmp_path, tiny_llama_dir, monkeypatch):
    options = s3["storage_options"]
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps(options))  # how the CLI passes the store's options
    fs = fsspec.filesystem("s3", **options)
    source = f"{s3['url']}/{uuid.uuid4().hex}/chats.jsonl"
    fs.pipe_file(source, _records("first answer"))
    recipe = _recipe(tmp_path, tiny_llama_dir, source, str(tmp_path / "store"))

    first = Plan.load(recipe)
    assert prepare_recipe(first.recipe, first.data).reused is False
    assert Plan.load(recipe).data.root == first.data.root  # unchanged source: same folder

    fs.pipe_file(source, _records("other answer"))  # same size, new content (and ETag)
    edited = Plan.load(recipe)
    assert edited.data.root != first.data.root
    prepared = prepare_recipe(edited.recipe, edited.data)
    assert prepared.reused is False
    messages = load_prepared(edited.data, TRAIN)["messages"].to_pylist()
    assert messages and all("other answer" in m for m in messages)


@pytest.mark.slow
def test_a_folder_source_follows_its_listing(s3, tmp_path, tiny_llama_dir, monkeypatch):
    options = s3["storage_options"]
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps(options))
    fs = fsspec.filesystem("s3", **options)
    folder = f"{s3['url']}/{uuid.uuid4().hex}/chats"
    fs.pipe_file(f"{folder}/a.jsonl", _records("a"))
    recipe = load_recipe(_recipe(tmp_path, tiny_llama_dir, folder, str(tmp_path / "store")))

    before = fingerprint(recipe, LAYER_IDS)
    assert fingerprint(recipe, LAYER_IDS) == before
    fs.pipe_file(f"{folder}/b.jsonl", _records("b"))
    assert fingerprint(recipe, LAYER_IDS) != before


def fresh_prefix(s3) -> tuple[dict, str, fsspec.AbstractFileSystem]:
    """The loopback server's options, a folder no other test writes, and a filesystem on it."""
    options = s3["storage_options"]
    return options, f"{s3['url']}/{uuid.uuid4().hex}", fsspec.filesystem("s3", **options)


@pytest.mark.slow
@pytest.mark.usefixtures("no_credentials")
def test_s3_source_and_store_read_with_the_stores_options_alone(s3, tmp_path, tiny_llama_dir):
    options, prefix, fs = fresh_prefix(s3)
    fs.pipe_file(f"{prefix}/chats.jsonl", _records("stored answer"))
    recipe = load_recipe(_recipe(tmp_path, tiny_llama_dir, f"{prefix}/chats.jsonl", f"{prefix}/store"))

    layout = DataLayout.for_recipe(f"{prefix}/store", recipe.name, "0123456789abcdef")
    prepared = prepare_recipe(recipe, layout, storage_options=options)
    assert prepared.report["kept"][TRAIN] == 5
    messages = load_prepared(layout, TRAIN, options)["messages"].to_pylist()
    assert all("stored answer" in m for m in messages)

    before = fingerprint(recipe, LAYER_IDS, options)
    fs.pipe_file(f"{prefix}/chats.jsonl", _records("edited answer"))
    assert fingerprint(recipe, LAYER_IDS, options) != before


@pytest.mark.slow
@pytest.mark.usefixtures("no_credentials")
def test_an_unreadable_s3_source_fails_the_fingerprint_naming_the_field(
    s3, tmp_path, tiny_llama_dir, monkeypatch
):
    recipe = load_recipe(
        _recipe(tmp_path, tiny_llama_dir, f"{s3['url']}/x/chats.jsonl", str(tmp_path / "store"))
    )
    unreachable = {
        **s3["storage_options"],
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},  # nothing listens there
        "retries": 1,
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps(unreachable))
    # A fingerprint that cannot see the source could not tell an edited one from the old one.
    with pytest.raises(RecipeError, match=r"data\.sources\[0\]\.path"):
        fingerprint(recipe, LAYER_IDS)


def _traffic_lines(at, answers: list[str]) -> bytes:
    rows = [
        {
            "timestamp": at.isoformat(),
            "request": {
                "messages": [{"role": "user", "content": f"question about {a}? mail me at ops@example.com"}]
            },
            "response": {"choices": [{"message": {"role": "assistant", "content": a}}]},
        }
        for a in answers
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.mark.slow
@pytest.mark.usefixtures("no_credentials")
def test_traffic_logs_and_segments_on_s3_with_the_stores_options_alone(s3, tmp_path, tiny_llama_dir):
    """Gzipped and plain logs found by an s3:// glob, two windows, the segment index on S3."""
    import gzip
    import time
    from datetime import UTC, datetime, timedelta

    from draftflow.data.chat import load_chat_encoder
    from draftflow.data.prepare import prepare
    from draftflow.data.segments import earlier_sample_ids, list_segment, list_segments

    options, prefix, fs = fresh_prefix(s3)
    before = datetime.now(UTC) - timedelta(hours=1)
    fs.pipe_file(f"{prefix}/logs/a.jsonl.gz", gzip.compress(_traffic_lines(before, ["one", "two", "three"])))
    fs.pipe_file(f"{prefix}/logs/b.jsonl", _traffic_lines(before, ["four", "five"]) + b"{broken\n")
    time.sleep(1.2)  # windows end on a whole second
    recipe = {
        "name": "s3-traffic",
        "target": {"model": str(tiny_llama_dir)},
        "data": {
            "sources": [{"kind": "traffic", "traffic": {"paths": [f"{prefix}/logs/*.jsonl*"]}}],
            "eval_samples": 0,
            "max_length": 64,
        },
        "extraction": {"store": f"{prefix}/store", "layer_ids": LAYER_IDS},
        "drafter": {"kind": "dflash"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    encoder = load_chat_encoder(load_recipe(str(path)).target)

    def window() -> tuple[Plan, dict]:
        plan = Plan.load(str(path), storage_options=options, segment="new")
        known = earlier_sample_ids(plan.store, "s3-traffic", plan.fingerprint, options)
        prepared = prepare(
            plan.recipe.data, plan.data, encoder, storage_options=options, window=plan.window, earlier=known
        )
        list_segment(plan.store, "s3-traffic", plan.fingerprint, plan.window, options)
        (stats,) = prepared.report["sources"].values()
        return plan, stats

    first, stats = window()
    assert stats["traffic"]["files"] == 2 and stats["traffic"]["redacted_conversations"] == 5
    assert stats["dropped"] == {"malformed_json": 1} and stats["selected"] == 5
    messages = " ".join(load_prepared(first.data, TRAIN, options)["messages"].to_pylist())
    assert "ops@example.com" not in messages and "[EMAIL]" in messages

    fs.pipe_file(f"{prefix}/logs/c.jsonl", _traffic_lines(datetime.now(UTC), ["six", "one"]))
    time.sleep(1.2)
    second, stats = window()
    assert second.window.since == first.window.until and second.data.root != first.data.root
    assert stats["selected"] == 1 and stats["dropped"]["seen_in_earlier_segment"] == 1
    assert stats["traffic"]["files_before_window"] == 2  # a.jsonl.gz and b.jsonl: not opened again
    assert [s["fingerprint"] for s in list_segments(f"{prefix}/store", "s3-traffic", options)] == [
        first.fingerprint,
        second.fingerprint,
    ]
