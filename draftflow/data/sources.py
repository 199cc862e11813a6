"""Readers for every recipe source kind, all returning the same normalised conversations.

A conversation is ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``: at most
one system message (first), then user/assistant turns that alternate, starting with a user
turn and ending with an assistant turn (only assistant tokens train a drafter, so a trailing
unanswered user turn is useless and is trimmed).

Bad input is never fatal: every conversation that is skipped adds one to a reason in the
``dropped`` Counter the caller passes in, so a report can say how much of a source was used.

The pip-shipped corpora (chitchat, chatterbot) are located with ``importlib.util.find_spec``
and read as files; importing those packages would run their code for nothing.

A source on an object store (``s3://…``) is read with the store's storage options (the
``storage_options`` argument; None: ``$DRAFTFLOW_STORAGE_OPTIONS``), like every other remote
folder of a run (:mod:`draftflow.remote`): its credentials need not be in the environment.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import yaml

from draftflow.paths import join
from draftflow.recipe.load import expand
from draftflow.recipe.schema import DataSource
from draftflow.remote import url_to_fs

Message = dict[str, str]
Conversation = list[Message]

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}

CHITCHAT_PACKAGE = "chitchat_dataset"
CHITCHAT_FILE = "dataset.json"
CHATTERBOT_PACKAGE = "chatterbot_corpus"
CHATTERBOT_ENGLISH = ("data", "english")


# ---------------------------------------------------------------------------------------
# Normalisation (shared by every kind)
# ---------------------------------------------------------------------------------------


def _text_of(content: Any) -> str | None:
    """Message content as text; OpenAI content-part lists keep their text parts. None = unusable."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                return None  # images, audio, tool calls: not something a text drafter can train on
        return "".join(parts)
    return None


def normalise_conversation(turns: Any) -> tuple[Conversation | None, str | None]:
    """Raw turns (role/content or from/value dicts) → (conversation, None) or (None, drop reason)."""
    if not isinstance(turns, list):
        return None, "malformed_record"
    if not turns:
        return None, "empty"
    out: Conversation = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "malformed_turn"
        raw_role = turn.get("role", turn.get("from"))
        role = ROLE_ALIASES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            return None, "unknown_role"
        text = _text_of(turn.get("content", turn.get("value")))
        if text is None:
            return None, "non_text_content"
        # Leading/trailing whitespace would also make token boundaries between the template's
        # text and the content unstable (BPE merges "\n" + "\nfoo"); it carries no meaning.
        text = text.strip()
        if not text:
            continue  # an empty turn says nothing; its neighbours may still form a dialogue
        if role == "system" and out:
            return None, "system_not_first"
        if out and out[-1]["role"] == role:
            # Split messages of one speaker (chat logs, some ShareGPT dumps) become one turn:
            # templates that insist on alternating roles would reject them otherwise.
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + text}
        else:
            out.append({"role": role, "content": text})
    head = out[:1] if out and out[0]["role"] == "system" else []
    body = out[len(head) :]
    while body and body[0]["role"] == "assistant":
        body.pop(0)  # a reply to nothing: no prompt to condition on
    while body and body[-1]["role"] == "user":
        body.pop()  # an unanswered question has no assistant tokens to learn
    if not any(m["role"] == "user" for m in out):
        return None, "no_user_turn" if out else "empty"
    if not body:
        return None, "no_assistant_turn"
    return head + body, None


def _normalised(records: Iterable[Any], dropped: Counter) -> Iterator[Conversation]:
    for record in records:
        conversation, reason = normalise_conversation(record)
        if conversation is None:
            dropped[reason] += 1
        else:
            yield conversation


def _turns_of_record(record: Any, keys: tuple[str, ...]) -> Any:
    """The turn list of one record: the first of ``keys`` present (None if there is none)."""
    if isinstance(record, list):
        return record
    if isinstance(record, dict):
        for key in keys:
            if key in record:
                return record[key]
    return None


# ---------------------------------------------------------------------------------------
# JSON / JSONL (sharegpt, messages)
# ---------------------------------------------------------------------------------------


def iter_json_values(text: str, dropped: Counter) -> Iterator[Any]:
    """Every item of a JSON array, or every value of JSONL / concatenated JSON, tolerating damage.

    A JSON array is decoded item by item (``raw_decode``), so a file cut off mid-item (the
    ShareGPT pip package ships one) still yields every complete item; the broken tail counts
    once as ``truncated_json``. In JSONL, a bad line counts as ``malformed_json`` and reading
    resumes at the next line.
    """
    decoder = json.JSONDecoder()
    n = len(text)
    pos = _skip_ws(text, 0)
    if pos < n and text[pos] == "[":
        pos = _skip_ws(text, pos + 1)
        while pos < n and text[pos] != "]":
            try:
                value, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                dropped["truncated_json"] += 1
                return  # no reliable way to find the next item boundary inside a broken one
            yield value
            pos = _skip_ws(text, pos)
            if pos < n and text[pos] == ",":
                pos = _skip_ws(text, pos + 1)
            elif pos < n and text[pos] != "]":
                dropped["truncated_json"] += 1
                return
        if pos >= n:
            dropped["truncated_json"] += 1  # all items complete, but the closing bracket is gone
        return
    while pos < n:
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            dropped["malformed_json"] += 1
            newline = text.find("\n", pos)
            pos = n if newline < 0 else newline + 1
        else:
            yield value
        pos = _skip_ws(text, pos)


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n\ufeff":
        pos += 1
    return pos


def _json_files(url: str, storage_options: dict | None) -> list[tuple[fsspec.AbstractFileSystem, str]]:
    """The file at ``url``, or every *.json / *.jsonl file under the folder at ``url`` (sorted)."""
    fs, path = url_to_fs(url, storage_options)
    if fs.isdir(path):
        found = sorted(p for p in fs.find(path) if p.endswith((".json", ".jsonl")))
        return [(fs, p) for p in found]
    if not fs.exists(path):
        raise FileNotFoundError(f"data source {url} does not exist")
    return [(fs, path)]


def _iter_json_records(url: str, dropped: Counter, storage_options: dict | None) -> Iterator[Any]:
    for fs, path in _json_files(url, storage_options):
        with fs.open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        yield from iter_json_values(text, dropped)


def read_sharegpt(url: str, dropped: Counter, storage_options: dict | None = None) -> Iterator[Conversation]:
    """ShareGPT JSON/JSONL: records with ``conversations`` of ``{"from", "value"}`` turns."""
    records = _iter_json_records(url, dropped, storage_options)
    yield from _normalised((_turns_of_record(r, ("conversations", "messages")) for r in records), dropped)


def read_messages(url: str, dropped: Counter, storage_options: dict | None = None) -> Iterator[Conversation]:
    """OpenAI-style JSON/JSONL: records with ``messages`` of ``{"role", "content"}`` turns."""
    records = _iter_json_records(url, dropped, storage_options)
    yield from _normalised((_turns_of_record(r, ("messages", "conversations")) for r in records), dropped)


# ---------------------------------------------------------------------------------------
# A `datasets` folder written by save_to_disk, read with pyarrow (no `datasets` dependency)
# ---------------------------------------------------------------------------------------


def _arrow_files(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """Data files of one saved split, in the order state.json lists them (row order matters)."""
    dict_file = join(folder, "dataset_dict.json")
    if fs.exists(dict_file):
        # A saved DatasetDict: its `train` split, else every `train*` split (UltraChat-200k has
        # train_sft/train_gen; duplicates between them are removed later), else every split.
        splits = json.loads(fs.cat_file(dict_file)).get("splits", [])
        chosen = ["train"] if "train" in splits else sorted(s for s in splits if s.startswith("train"))
        chosen = chosen or sorted(splits)
        return [f for split in chosen for f in _arrow_files(fs, join(folder, split))]
    state_file = join(folder, "state.json")
    if fs.exists(state_file):
        state = json.loads(fs.cat_file(state_file))
        names = [entry["filename"] for entry in state.get("_data_files", [])]
        if names:
            return [join(folder, name) for name in names]
    return sorted(p for p in fs.find(folder, maxdepth=1) if p.endswith(".arrow"))


def _iter_arrow_rows(fs: fsspec.AbstractFileSystem, path: str, columns: list[str]) -> Iterator[dict]:
    import pyarrow as pa

    with fs.open(path, "rb") as f:
        data = f.read()
    try:
        reader = pa.ipc.open_stream(data)  # what save_to_disk writes
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(data)  # the random-access variant, for hand-written folders
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(reader)
    for batch in batches:
        present = [c for c in columns if c in batch.schema.names]
        yield from batch.select(present).to_pylist()


def read_hf_disk(url: str, dropped: Counter, storage_options: dict | None = None) -> Iterator[Conversation]:
    """A ``datasets.save_to_disk`` folder with a ``messages`` or ``conversations`` column."""
    fs, folder = url_to_fs(url, storage_options)
    if not fs.isdir(folder):
        raise FileNotFoundError(f"hf_disk source {url} is not a folder")
    files = _arrow_files(fs, folder)
    if not files:
        raise FileNotFoundError(f"hf_disk source {url} has no .arrow data files")
    keys = ("messages", "conversations")
    for path in files:
        rows = _iter_arrow_rows(fs, path, list(keys))
        yield from _normalised((_turns_of_record(row, keys) for row in rows), dropped)


# ---------------------------------------------------------------------------------------
# Corpora shipped by pip packages
# ---------------------------------------------------------------------------------------


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise FileNotFoundError(f"package {package} is not installed: pip install {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def read_chitchat(dropped: Counter) -> Iterator[Conversation]:
    """Chit-chat dialogues between two people: speakers alternate user/assistant, user first.

    Each conversation is a list of rounds, a round being one sender's consecutive messages;
    a round becomes one turn (its messages joined by newlines).
    """
    path = package_dir(CHITCHAT_PACKAGE) / CHITCHAT_FILE
    data = json.loads(path.read_text(encoding="utf-8"))

    def records() -> Iterator[Any]:
        for entry in data.values():
            rounds = entry.get("messages") if isinstance(entry, dict) else None
            if not isinstance(rounds, list):
                yield None
                continue
            turns: list[dict] = []
            last_sender = None
            for round_ in rounds:
                for utterance in round_ if isinstance(round_, list) else []:
                    text = utterance.get("text") if isinstance(utterance, dict) else None
                    if not isinstance(text, str) or not text.strip():
                        continue
                    sender = utterance.get("sender")
                    if turns and sender == last_sender:
                        turns[-1]["content"] += "\n" + text
                    else:
                        role = "user" if len(turns) % 2 == 0 else "assistant"
                        turns.append({"role": role, "content": text})
                        last_sender = sender
            yield turns

    yield from _normalised(records(), dropped)


def read_chatterbot(dropped: Counter) -> Iterator[Conversation]:
    """The English chatterbot corpus: each YAML ``- - question\\n  - answer…`` list alternates user/assistant."""
    folder = package_dir(CHATTERBOT_PACKAGE).joinpath(*CHATTERBOT_ENGLISH)
    files = sorted(folder.glob("*.yml")) + sorted(folder.glob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no chatterbot YAML files under {folder}")

    def records() -> Iterator[Any]:
        for path in files:
            try:
                # BaseLoader keeps every scalar a string: with safe_load an answer "Yes" or "No"
                # would silently become a boolean.
                doc = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
            except yaml.YAMLError:
                dropped["malformed_yaml"] += 1
                continue
            for conv in (doc or {}).get("conversations") or []:
                if not isinstance(conv, list) or not all(isinstance(t, str) for t in conv):
                    yield None
                    continue
                yield [
                    {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(conv)
                ]

    yield from _normalised(records(), dropped)


# ---------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------


def read_source(
    source: DataSource, dropped: Counter, storage_options: dict | None = None
) -> Iterator[Conversation]:
    """Every usable conversation of one recipe source, in source order; skips counted in ``dropped``.

    ``storage_options``: the store's fsspec options, used for a source on an object store."""
    if source.kind == "sharegpt":
        return read_sharegpt(expand(source.path), dropped, storage_options)
    if source.kind == "messages":
        return read_messages(expand(source.path), dropped, storage_options)
    if source.kind == "hf_disk":
        return read_hf_disk(expand(source.path), dropped, storage_options)
    if source.kind == "chitchat":
        return read_chitchat(dropped)
    if source.kind == "chatterbot":
        return read_chatterbot(dropped)
    if source.kind == "self_generated":
        raise ValueError(
            "a self_generated source has no file to read: the target writes it during preparation"
        )
    raise ValueError(f"unknown data source kind {source.kind!r}")


def load_source(
    source: DataSource, storage_options: dict | None = None
) -> tuple[list[Conversation], Counter]:
    """All conversations of a source and the counts of what was dropped (convenience for tests/CLI)."""
    dropped: Counter = Counter()
    return list(read_source(source, dropped, storage_options)), dropped


def source_label(index: int, source: DataSource) -> str:
    """A short, unique name for a source in reports and the ``source`` column."""
    if source.path:
        return f"{index}:{source.kind}:{Path(source.path.rstrip('/')).name}"
    return f"{index}:{source.kind}"
