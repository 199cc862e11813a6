"""What the pipeline needs to know about a target model, read from its `config.json`.

The config is read from a local folder or, for a hub id, from the local Hugging Face
cache only: validation must never download anything. When neither has it,
:func:`read_target_info` returns ``None`` and callers report the checks they skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TargetInfo:
    num_layers: int
    hidden_size: int
    vocab_size: int
    architectures: tuple[str, ...]
    config_path: str

    def default_layer_ids(self) -> list[int]:
        """The speculators convention: aux layers [2, L//2, L-3] plus the last layer L."""
        n = self.num_layers
        return sorted({2, n // 2, n - 3, n})


def find_config_file(model: str, revision: str | None = None) -> Path | None:
    local = Path(model).expanduser()
    if local.is_dir():
        cfg = local / "config.json"
        return cfg if cfg.is_file() else None
    if local.exists() or model.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    hit = try_to_load_from_cache(model, "config.json", revision=revision)
    return Path(hit) if isinstance(hit, str) else None


def read_target_info(model: str, revision: str | None = None) -> TargetInfo | None:
    path = find_config_file(model, revision)
    if path is None:
        return None
    cfg = json.loads(path.read_text())
    # Multimodal configs (Gemma 3/4, Qwen-VL) keep the language model under text_config.
    text = cfg.get("text_config") or cfg
    return TargetInfo(
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text.get("vocab_size") or cfg["vocab_size"]),
        architectures=tuple(cfg.get("architectures") or ()),
        config_path=str(path),
    )
