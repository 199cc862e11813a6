"""The traffic source: served logs of one window, streamed, counted, redacted; one segment per window."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from draftflow.data.prepare import select_conversations
from draftflow.data.segments import (
    Window,
    earlier_sample_ids,
    last_until,
    list_segment,
    list_segments,
    resolve_window,
)
from draftflow.data.traffic import read_traffic
from draftflow.paths import DataLayout, segment_index
from draftflow.recipe.schema import DataSection, DataSource
from draftflow.recipe.traffic_section import TrafficSection

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def exchange(at: datetime, question: str, answer: str, *, logged_reply: bool = True) -> dict:
    """One line as a gateway logs it: the request, the response, and when."""
    request = {"model": "target", "messages": [{"role": "user", "content": question}]}
    if not logged_reply:
        request["messages"].append({"role": "assistant", "content": answer})
        return {"timestamp": at.isoformat(), "request": request}
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
    return {"timestamp": at.isoformat(), "request": request, "response": response}


def write_log(path: Path, lines: list, *, gz: bool = False) -> Path:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def read(settings: TrafficSection, window: Window) -> tuple[list, Counter, Counter]:
    dropped, counts = Counter(), Counter()
    return list(read_traffic(settings, window, dropped, counts)), dropped, counts


def test_lines_of_the_window_become_conversations_and_the_rest_is_counted(tmp_path):
    write_log(
        tmp_path / "logs" / "a.jsonl",
        [
            exchange(T0 + timedelta(hours=1), "What is 2+2?", "4."),
            exchange(T0 - timedelta(hours=1), "Before the window", "no"),
            exchange(T0 + timedelta(days=2), "After the window", "no"),
            "{not json",
            {"request": {"messages": [{"role": "user", "content": "no time"}]}},
            exchange(T0 + timedelta(hours=2), "Already answered", "Yes, in the request.", logged_reply=False),
            [1, 2],
        ],
    )
    write_log(
        tmp_path / "logs" / "b.jsonl.gz",
        [exchange(T0 + timedelta(hours=3), "Compressed?", "Read on the fly.")],
        gz=True,
    )
    settings = TrafficSection(paths=[str(tmp_path / "logs" / "*.jsonl*")])
    conversations, dropped, counts = read(settings, Window(T0, T0 + timedelta(days=1)))
    assert [c[0]["content"] for c in conversations] == ["What is 2+2?", "Already answered", "Compressed?"]
    assert conversations[0] == [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
    ]
    assert dropped == Counter(outside_window=2, malformed_json=1, no_timestamp=1, malformed_record=1)
    assert counts["lines"] == 8 and counts["files"] == 2


def test_nested_timestamps_unix_seconds_and_length_filters(tmp_path):
    def line(seconds: float, answer: str) -> dict:
        record = exchange(T0, "q", answer)
        del record["timestamp"]
        record["request"]["created"] = seconds
        return record

    start = T0.timestamp()
    write_log(
        tmp_path / "x.jsonl",
        [line(start + 10, "short"), line(start + 20, "x" * 500), line((start + 30) * 1000, "just right")],
    )
    settings = TrafficSection(
        paths=[str(tmp_path / "x.jsonl")], timestamp_field="request.created", min_chars=7, max_chars=100
    )
    conversations, dropped, _ = read(settings, Window(T0, T0 + timedelta(hours=1)))
    assert [c[1]["content"] for c in conversations] == ["just right"]  # milliseconds read as such
    assert dropped == Counter(too_short=1, too_long=1)


def test_planted_secrets_are_redacted_before_anything_leaves_the_reader(tmp_path):
    planted = ["jane.doe@example.com", "sk-proj-abcdefghijklmnopqrstuvwx1234", "4111 1111 1111 1111"]
    write_log(
        tmp_path / "s.jsonl",
        [
            exchange(T0, f"Mail {planted[0]} my key {planted[1]}", "Done."),
            exchange(T0, "Charge my card", f"Charged {planted[2]}."),
            exchange(T0, "Nothing to hide", "Good."),
        ],
    )
    conversations, _, counts = read(
        TrafficSection(paths=[str(tmp_path / "s.jsonl")]), Window(None, T0 + timedelta(1))
    )
    text = json.dumps(conversations)
    assert not [secret for secret in planted if secret in text]
    assert counts["redacted_conversations"] == 2
    assert counts["redacted:email"] == 1 and counts["redacted:api_key"] == 1 and counts["redacted:card"] == 1

    kept, _, counts = read(
        TrafficSection(paths=[str(tmp_path / "s.jsonl")], redact=False), Window(None, T0 + timedelta(1))
    )
    assert planted[0] in json.dumps(kept) and not counts["redacted_conversations"]  # the switch works


def test_a_custom_redaction_function_runs_on_every_turn(tmp_path):
    write_log(tmp_path / "c.jsonl", [exchange(T0, "hello world", "bye world")])
    settings = TrafficSection(paths=[str(tmp_path / "c.jsonl")], redact=False, redact_with="string:capwords")
    conversations, _, counts = read(settings, Window(None, T0 + timedelta(1)))
    assert [m["content"] for m in conversations[0]] == ["Hello World", "Bye World"]
    assert counts["redacted:custom"] == 2


def test_a_line_the_custom_redaction_fails_on_is_dropped_without_its_text(tmp_path, monkeypatch, caplog):
    (tmp_path / "scrubbers.py").write_text(
        "def strict(text):\n"
        "    if 'SECRET' in text:\n"
        "        raise ValueError(f'cannot scrub {text!r}')\n"
        "    return text.lower()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = [exchange(T0, "First Question", "A"), exchange(T0, "the SECRET-4242 one", "B")]
    write_log(tmp_path / "s.jsonl", [*lines, exchange(T0, "Last Question", "C")])
    settings = TrafficSection(paths=[str(tmp_path / "s.jsonl")], redact_with="scrubbers:strict")
    conversations, dropped, counts = read(settings, Window(None, T0 + timedelta(1)))
    assert [c[0]["content"] for c in conversations] == ["first question", "last question"]  # the file goes on
    assert dropped["redaction_failed"] == 1 and counts["unreadable_files"] == 0
    assert "ValueError" in caplog.text and "redaction_failed" in caplog.text
    assert "SECRET-4242" not in caplog.text


def test_an_unreadable_file_fails_that_file_not_the_run(tmp_path):
    good = gzip.compress(b"".join(json.dumps(exchange(T0, f"q{i}", "a")).encode() + b"\n" for i in range(3)))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "1-cut.jsonl.gz").write_bytes(good[: len(good) // 2])  # a copy cut short
    write_log(tmp_path / "logs" / "2-fine.jsonl", [exchange(T0, "still read", "yes")])
    settings = TrafficSection(paths=[str(tmp_path / "logs" / "*")])
    conversations, _, counts = read(settings, Window(None, T0 + timedelta(1)))
    assert conversations[-1][0]["content"] == "still read"
    assert counts["unreadable_files"] == 1 and counts["files"] == 2


def test_a_file_last_written_before_the_window_is_not_opened(tmp_path):
    old = write_log(tmp_path / "old.jsonl", [exchange(T0 + timedelta(days=5), "clock skew", "a")])
    week_ago = (T0 - timedelta(days=7)).timestamp()
    os.utime(old, (week_ago, week_ago))
    settings = TrafficSection(paths=[str(tmp_path / "*.jsonl")])
    conversations, _, counts = read(settings, Window(T0, T0 + timedelta(days=10)))
    assert not conversations and counts["files_before_window"] == 1 and not counts["lines"]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"kind": "traffic"}, "needs `traffic` settings"),
        ({"kind": "traffic", "path": "x", "traffic": {"paths": ["x"]}}, "not `path`"),
        ({"kind": "messages", "path": "x", "traffic": {"paths": ["x"]}}, "need `kind: traffic`"),
        ({"kind": "traffic", "traffic": {"paths": ["x"], "since": "yesterday"}}, "`since` is `last_run`"),
        (
            {"kind": "traffic", "traffic": {"paths": ["x"], "redact_with": "no colon"}},
            "package.module:function",
        ),
        ({"kind": "traffic", "traffic": {"paths": []}}, "paths"),
    ],
)
def test_a_wrong_traffic_source_names_the_problem(source, message):
    with pytest.raises(ValidationError, match=message):
        DataSource.model_validate(source)


def test_one_traffic_source_per_recipe():
    traffic = {"kind": "traffic", "traffic": {"paths": ["x"]}}
    with pytest.raises(ValidationError, match="at most one `traffic` source"):
        DataSection.model_validate({"sources": [traffic, traffic]})


def _listed_segment(store: Path, name: str, fingerprint: str, window: Window, ids: list[str]) -> dict:
    layout = DataLayout.for_recipe(str(store), name, fingerprint)
    Path(layout.prepared_dir).mkdir(parents=True)
    pq.write_table(pa.table({"sample_id": ids}), layout.samples)
    Path(layout.prepare_report).write_text(json.dumps({"kept": {"train": len(ids)}, "sources": {}}))
    return list_segment(str(store), name, fingerprint, window)


def test_segments_are_listed_once_and_set_where_the_next_window_starts(tmp_path):
    store = tmp_path / "store"
    assert last_until(str(store), "r") is None and list_segments(str(store), "r") == []
    first = Window(None, T0)
    entry = _listed_segment(store, "r", "aaaaaaaaaaaaaaaa", first, ["s1", "s2"])
    assert entry["counts"]["kept"] == 2 and entry["folder"] == "r-aaaaaaaaaaaaaaaa"
    assert list_segment(str(store), "r", "aaaaaaaaaaaaaaaa", first) == entry  # listed once
    _listed_segment(store, "r", "bbbbbbbbbbbbbbbb", Window(T0, T0 + timedelta(days=1)), ["s3"])
    assert len(Path(segment_index(str(store), "r")).read_text().splitlines()) == 2
    assert last_until(str(store), "r") == T0 + timedelta(days=1)
    assert earlier_sample_ids(str(store), "r", "bbbbbbbbbbbbbbbb") == {"s1", "s2"}

    window = resolve_window(TrafficSection(paths=["x"]), str(store), "r", None)
    assert window.since == T0 + timedelta(days=1) and window.until > window.since
    week = resolve_window(TrafficSection(paths=["x"], since="7d"), str(store), "r", None)
    assert week.until - week.since == timedelta(days=7)
    fixed = resolve_window(TrafficSection(paths=["x"], since="2026-10-01T00:00:00Z"), str(store), "r", None)
    assert fixed.since == datetime(2026, 10, 1, tzinfo=UTC)
    assert Window.from_dict(window.as_dict()) == window


def test_a_new_segment_keeps_nothing_an_earlier_one_kept(tmp_path):
    write_log(
        tmp_path / "t.jsonl",
        [exchange(T0 + timedelta(minutes=i), f"question {i}", f"answer {i}") for i in range(6)],
    )
    data = DataSection.model_validate(
        {
            "sources": [{"kind": "traffic", "traffic": {"paths": [str(tmp_path / "t.jsonl")]}}],
            "eval_samples": 1,
        }
    )
    window = Window(None, T0 + timedelta(hours=1))
    first, _ = select_conversations(data, window=window)
    earlier = {c.sample_id for c in first[:4]}
    second, stats = select_conversations(data, window=window, earlier=earlier)
    assert {c.sample_id for c in second} == {c.sample_id for c in first} - earlier
    (label,) = stats
    assert stats[label]["dropped"]["seen_in_earlier_segment"] == 4
    assert stats[label]["traffic"]["lines"] == 6 and stats[label]["traffic"]["window"] == window.as_dict()


def test_a_redaction_function_that_does_not_import_fails_validation_naming_the_field(tmp_path, smollm2_dir):
    import yaml

    from draftflow.recipe.checks import validate
    from draftflow.recipe.load import RecipeError

    recipe = {
        "name": "t",
        "target": {"model": str(smollm2_dir)},
        "data": {
            "sources": [
                {"kind": "traffic", "traffic": {"paths": ["x"], "redact_with": "no_such_module_here:scrub"}}
            ]
        },
        "drafter": {"kind": "dflash"},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match=r"data\.sources\[0\]\.traffic\.redact_with: .*no_such_module_here"):
        validate(str(path))


def test_reading_stages_plan_the_newest_segment_and_say_when_there_is_none(tmp_path, smollm2_dir):
    import yaml

    from draftflow.plan import Plan
    from draftflow.recipe.load import RecipeError

    recipe = {
        "name": "r",
        "target": {"model": str(smollm2_dir)},
        "data": {"sources": [{"kind": "traffic", "traffic": {"paths": [str(tmp_path / "*.jsonl")]}}]},
        "extraction": {"store": str(tmp_path / "store")},
        "drafter": {"kind": "dflash"},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match="no traffic segment is listed .* run the extract or pipeline flow"):
        Plan.load(str(path))
    new = Plan.load(str(path), segment="new")
    assert new.window.since is None
    _listed_segment(tmp_path / "store", "r", new.fingerprint, new.window, ["s1"])
    newest = Plan.load(str(path))
    assert (newest.window, newest.fingerprint, newest.data) == (new.window, new.fingerprint, new.data)
    later = Plan.load(str(path), segment="new")
    assert later.window.since == new.window.until and later.fingerprint != new.fingerprint


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"data": {"sources": [{"kind": "chatterbot"}]}}, "refresh: needs a `traffic` data source"),
        ({"publish": {"destination": "hf://team/drafter"}}, "release pointer"),
        ({"refresh": {"replay": 1.5}}, "refresh.replay"),
        ({"refresh": {"epochs": 0}}, "refresh.epochs"),
    ],
)
def test_a_refresh_section_names_what_it_needs(changes, message, tmp_path, smollm2_dir):
    import yaml

    from draftflow.recipe.checks import validate
    from draftflow.recipe.load import RecipeError

    recipe = {
        "name": "r",
        "target": {"model": str(smollm2_dir)},
        "data": {"sources": [{"kind": "traffic", "traffic": {"paths": ["x"]}}]},
        "drafter": {"kind": "dflash"},
        "publish": {"destination": str(tmp_path / "dest")},
        "refresh": {},
        **changes,
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match=message):
        validate(str(path))
