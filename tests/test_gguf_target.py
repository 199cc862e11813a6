"""The pip-shipped GGUF target converted to a safetensors folder, as bootstrap does it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.gguf_target import HOW_WRITTEN, convert, smollm2_gguf
from draftflow.recipe import fingerprint, validate

DEMO = str(Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-dflash-cpu-demo.yaml")


def _json_without(path: Path, fields: tuple[str, ...]) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in fields}


@pytest.mark.slow  # ~25 s: dequantises and saves 135M parameters
def test_conversion_records_nothing_about_how_it_was_written_so_the_data_fingerprint_holds(
    smollm2_dir, tmp_path
):
    # The converted folder's json files are hashed byte for byte into the data fingerprint.
    # Converting with transformers 5.24.0 and 5.25.0 gave identical weights, tokenizer and
    # template; config.json and generation_config.json differed only in the release they record,
    # and tokenizer_config.json records local_files_only, which HF_HUB_OFFLINE (set by these tests,
    # not by bootstrap) turns to true.
    from transformers import AutoTokenizer

    out = convert(smollm2_gguf(), tmp_path / "SmolLM2-135M-Instruct")
    for name, fields in HOW_WRITTEN.items():
        written = json.loads((out / name).read_text())
        assert not set(fields) & set(written), (name, fields)
        assert written == _json_without(smollm2_dir / name, fields), name  # nothing else dropped
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
    assert (out / "model.safetensors").stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size

    chat = [{"role": "user", "content": "Name three prime numbers."}]
    ids = [
        AutoTokenizer.from_pretrained(d).apply_chat_template(chat, tokenize=True)["input_ids"]
        for d in (out, smollm2_dir)
    ]
    assert ids[0] == ids[1] and len(ids[0]) > 5

    def fp() -> str:
        v = validate(DEMO, [f"target.model={out}"])
        return fingerprint(v.recipe, v.layer_ids)

    before = fp()
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "transformers_version": "9.9.9"}, indent=2) + "\n")
    assert fp() != before, "the fingerprint sees the files' bytes: the converter must leave such fields out"
