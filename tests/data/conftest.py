"""Fixtures for the data-preparation tests: the real SmolLM2 tokenizer and small source files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# A Qwen3-like template: ChatML, plus Qwen3's <think> handling. Assistant turns after the last
# user message carry a <think> block (empty if the turn has no reasoning, always for the last
# turn); earlier assistant turns lose their reasoning. Rendering [u1, a1] and [u1, a1, u2, a2]
# therefore gives a1 two different forms: the case the loss-mask derivation must survive.
QWEN3_LIKE_TEMPLATE = """
{%- set ns = namespace(last_query_index=-1) -%}
{%- for message in messages -%}
  {%- if message.role == "user" -%}{%- set ns.last_query_index = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- if message.role == "system" or message.role == "user" -%}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
  {%- elif message.role == "assistant" -%}
    {%- set content = message.content -%}
    {%- set reasoning = '' -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) -%}
      {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
    {%- else -%}
      {{- '<|im_start|>assistant\\n' + content -}}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def qwen3_like_template() -> str:
    return QWEN3_LIKE_TEMPLATE


def sharegpt_record(*turns: tuple[str, str], **extra) -> dict:
    return {"id": extra.pop("id", "x"), "conversations": [{"from": f, "value": v} for f, v in turns], **extra}


def chat_records(n: int, prefix: str = "q") -> list[dict]:
    """``n`` distinct two-turn ShareGPT records."""
    return [
        sharegpt_record(
            ("human", f"{prefix} question {i}: what is {i} plus {i}?"), ("gpt", f"{i} plus {i} is {2 * i}.")
        )
        for i in range(n)
    ]


@pytest.fixture
def sg():
    """ShareGPT record builders: sg.record(("human", "q"), ("gpt", "a")), sg.records(n)."""

    class Builders:
        record = staticmethod(sharegpt_record)
        records = staticmethod(chat_records)

    return Builders


@pytest.fixture
def write_json(tmp_path: Path):
    """write_json(name, obj) → path of a JSON file; write_json(name, list, jsonl=True) → JSONL."""

    def write(name: str, obj, jsonl: bool = False) -> Path:
        path = tmp_path / name
        if jsonl:
            path.write_text("".join(json.dumps(o) + "\n" for o in obj), encoding="utf-8")
        else:
            path.write_text(json.dumps(obj, indent=1), encoding="utf-8")
        return path

    return write


def write_hf_disk(folder: Path, rows: list[dict], column: str, files: int = 1) -> Path:
    """A folder laid out like ``datasets.Dataset.save_to_disk``: Arrow IPC streams + state/info JSON."""
    import pyarrow as pa

    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
    per_file = -(-len(rows) // files)
    for i, name in enumerate(names):
        chunk = rows[i * per_file : (i + 1) * per_file]
        table = pa.Table.from_pylist(chunk) if chunk else pa.table({column: pa.array([], pa.null())})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=2)  # several record batches per file
    (folder / "dataset_info.json").write_text(json.dumps({"features": {column: {}}}))
    (folder / "state.json").write_text(
        json.dumps(
            {
                "_data_files": [{"filename": n} for n in names],
                "_fingerprint": "f",
                "_split": "train",
            }
        )
    )
    return folder


@pytest.fixture
def hf_disk_writer():
    return write_hf_disk
