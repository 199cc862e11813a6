"""Every source kind parses into normalised conversations; bad input is counted, not fatal."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from draftflow.data.sources import (
    iter_json_values,
    load_source,
    normalise_conversation,
    source_label,
)
from draftflow.recipe.schema import DataSource


def roles(conversation):
    return [m["role"] for m in conversation]


def test_sharegpt_json_roles_normalised(write_json, sg):
    records = [
        sg.record(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello!")),
        sg.record(("user", "A"), ("chatgpt", "B"), ("Human", "C"), ("bing", "D")),
        sg.record(("human", "E"), ("bard", "F")),
        sg.record(("human", "G"), ("model", "H"), ("human", "I"), ("assistant", "J")),
    ]
    convs, dropped = load_source(DataSource(kind="sharegpt", path=str(write_json("sg.json", records))))
    assert not dropped
    assert convs[0] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert [roles(c) for c in convs[1:]] == [
        ["user", "assistant", "user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant"] * 2,
    ]
    assert [m["content"] for m in convs[1]] == ["A", "B", "C", "D"]


def test_sharegpt_jsonl_malformed_line_counted(tmp_path, sg):
    good = sg.record(("human", "Q"), ("gpt", "A"))
    path = tmp_path / "sg.jsonl"
    path.write_text(json.dumps(good) + "\n{not json at all\n" + json.dumps(good).replace("Q", "Q2") + "\n")
    convs, dropped = load_source(DataSource(kind="sharegpt", path=str(path)))
    assert [c[0]["content"] for c in convs] == ["Q", "Q2"]
    assert dropped == Counter({"malformed_json": 1})


def test_truncated_json_array_keeps_complete_items(tmp_path, sg):
    records = [sg.record(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(5)]
    text = json.dumps(records)
    cut = text[: text.index('"q4"') + 2]  # cut inside the fifth item, like the pip ShareGPT file
    path = tmp_path / "sharegpt_truncated.json"
    path.write_text(cut)
    convs, dropped = load_source(DataSource(kind="sharegpt", path=str(path)))
    assert [c[0]["content"] for c in convs] == ["q0", "q1", "q2", "q3"]
    assert dropped == Counter({"truncated_json": 1})


def test_iter_json_values_missing_closing_bracket_counted():
    dropped = Counter()
    assert list(iter_json_values('[{"a": 1}, {"b": 2}', dropped)) == [{"a": 1}, {"b": 2}]
    assert dropped == Counter({"truncated_json": 1})


@pytest.mark.parametrize(
    ("turns", "reason"),
    [
        ([], "empty"),
        ([{"from": "human", "value": "  "}, {"from": "gpt", "value": ""}], "empty"),
        ([{"from": "human", "value": "only a question"}], "no_assistant_turn"),
        ([{"from": "gpt", "value": "a reply to nothing"}], "no_user_turn"),
        ([{"from": "human", "value": "q"}, {"from": "tool", "value": "x"}], "unknown_role"),
        ([{"from": "human", "value": "q"}, {"from": "gpt", "value": 3}], "non_text_content"),
        (
            [
                {"from": "human", "value": "q"},
                {"from": "system", "value": "s"},
                {"from": "gpt", "value": "a"},
            ],
            "system_not_first",
        ),
        (["not a dict"], "malformed_turn"),
        ("not a list", "malformed_record"),
        (None, "malformed_record"),
    ],
)
def test_unusable_conversations_have_a_reason(turns, reason):
    assert normalise_conversation(turns) == (None, reason)


def test_normalisation_trims_merges_and_keeps_dialogue():
    conv, reason = normalise_conversation(
        [
            {"from": "gpt", "value": "leading reply"},
            {"from": "human", "value": "  part one "},
            {"from": "human", "value": "part two"},
            {"from": "gpt", "value": ""},  # empty turn vanishes; its neighbours merge
            {"from": "human", "value": "part three"},
            {"from": "gpt", "value": "answer"},
            {"from": "human", "value": "unanswered"},
        ]
    )
    assert reason is None
    assert conv == [
        {"role": "user", "content": "part one\n\npart two\n\npart three"},
        {"role": "assistant", "content": "answer"},
    ]


def test_messages_jsonl_with_content_parts(write_json):
    records = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Look: "}, {"type": "text", "text": "x"}],
                },
                {"role": "assistant", "content": "Seen."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
                {"role": "assistant", "content": "A cat."},
            ]
        },
        {"messages": []},
        {"no_messages_key": True},
    ]
    convs, dropped = load_source(
        DataSource(kind="messages", path=str(write_json("m.jsonl", records, jsonl=True)))
    )
    assert [c[0]["content"] for c in convs] == ["Hi", "Look: x"]
    assert dropped == Counter({"non_text_content": 1, "empty": 1, "malformed_record": 1})


def test_folder_of_json_files(tmp_path, write_json, sg):
    folder = tmp_path / "many"
    folder.mkdir()
    (folder / "b.jsonl").write_text(json.dumps(sg.record(("human", "from b"), ("gpt", "ok"))) + "\n")
    (folder / "a.json").write_text(json.dumps([sg.record(("human", "from a"), ("gpt", "ok"))]))
    (folder / "notes.txt").write_text("ignored")
    convs, _ = load_source(DataSource(kind="sharegpt", path=str(folder)))
    assert [c[0]["content"] for c in convs] == ["from a", "from b"]


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_source(DataSource(kind="sharegpt", path=str(tmp_path / "nope.json")))


def test_hf_disk_messages_column(tmp_path, hf_disk_writer):
    rows = [
        {
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
            "id": i,
        }
        for i in range(5)
    ]
    rows.append({"messages": [{"role": "user", "content": "no answer"}], "id": 5})
    folder = hf_disk_writer(tmp_path / "saved", rows, "messages", files=2)
    convs, dropped = load_source(DataSource(kind="hf_disk", path=str(folder)))
    assert [c[1]["content"] for c in convs] == [f"a{i}" for i in range(5)]  # state.json file order kept
    assert dropped == Counter({"no_assistant_turn": 1})


def test_hf_disk_conversations_column_and_dataset_dict(tmp_path, hf_disk_writer):
    rows = [{"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}]
    hf_disk_writer(tmp_path / "dd" / "train", rows, "conversations")
    hf_disk_writer(
        tmp_path / "dd" / "test",
        [{"conversations": [{"from": "human", "value": "t"}, {"from": "gpt", "value": "t"}]}],
        "conversations",
    )
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    convs, dropped = load_source(DataSource(kind="hf_disk", path=str(tmp_path / "dd")))
    assert convs == [[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]]
    assert not dropped


def test_chitchat_from_installed_package():
    convs, dropped = load_source(DataSource(kind="chitchat"))
    assert len(convs) > 3000
    for conv in convs:
        assert roles(conv) == ["user", "assistant"] * (len(conv) // 2)
    # Conversations where only one person spoke have no reply to learn: counted, not fatal.
    assert dropped["no_assistant_turn"] > 0
    assert set(dropped) <= {"no_assistant_turn", "duplicate", "empty"}


def test_chatterbot_english_corpus_from_installed_package():
    convs, dropped = load_source(DataSource(kind="chatterbot"))
    assert len(convs) > 1500
    assert [
        {"role": "user", "content": "What is your number"},
        {"role": "assistant", "content": "I don't have any number"},
    ] in convs
    for conv in convs:
        assert roles(conv) == ["user", "assistant"] * (len(conv) // 2)
        assert all(isinstance(m["content"], str) and m["content"] for m in conv)
    # trivia.yml has one entry whose bad indentation makes it a plain string: counted.
    assert set(dropped) <= {"malformed_record"} and dropped["malformed_record"] <= 2


def test_pip_corpora_found_without_importing_them():
    code = (
        "import sys; from draftflow.data.sources import load_source; from draftflow.recipe.schema import DataSource;"
        "load_source(DataSource(kind='chatterbot'));"
        "assert 'chatterbot_corpus' not in sys.modules and 'chitchat_dataset' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_source_labels_are_distinct():
    a = DataSource(kind="sharegpt", path="/x/train.json")
    b = DataSource(kind="sharegpt", path="/y/train.json")
    assert source_label(0, a) != source_label(1, b)
    assert source_label(2, DataSource(kind="chitchat")) == "2:chitchat"
