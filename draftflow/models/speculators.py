"""The speculators-format folder (``config.json`` + ``model.safetensors``) both drafters export.

What vLLM 0.32 requires (``vllm/transformers_utils/configs/speculators/{base,algos}.py``):
``speculators_model_type``, ``transformer_layer_config`` (dict),
``speculators_config.proposal_methods[0].speculative_tokens`` and
``speculators_config.verifier.name_or_path``; DFlash also ``mask_token_id`` and
``aux_hidden_state_layer_ids``; Eagle3 reads ``eagle_aux_hidden_state_layer_ids`` and
``norm_before_residual`` (default true when absent). ``speculators_version`` is not read by
vLLM; it records the speculators release whose format this follows.

Weights are stored without a ``model.`` prefix; vLLM adds it itself. ``d2t``/``t2d`` are
written only for a reduced vocabulary: vLLM has no ``draft_id_to_target_id`` parameter when
the draft vocab equals the target's and would reject them. ``embed_tokens`` is optional
(vLLM then shares the target's); :func:`read_folder` callers fetch it from the verifier.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from draftflow.models.target_weights import load_embeddings
from draftflow.paths import EXPORT_CONFIG, EXPORT_WEIGHTS, PROVENANCE

SPECULATORS_FORMAT_VERSION = "0.9.0"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


def check_aux_layer_ids(ids: list[int], expected: int) -> list[int]:
    """Layer ids as vLLM uses them: ascending (vLLM sorts them), unique, one per fc input block."""
    ids = [int(i) for i in ids]
    if ids != sorted(set(ids)):
        raise ValueError(f"aux layer ids {ids} must be unique and ascending (vLLM sorts them)")
    if len(ids) != expected:
        raise ValueError(f"{len(ids)} aux layer ids for an fc that reads {expected} layers")
    if ids and ids[0] < 0:
        raise ValueError(f"aux layer ids {ids} must be >= 0")
    return ids


def layer_config(
    *,
    model_type: str,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rms_norm_eps: float,
    rope_theta: float,
    max_position_embeddings: int,
    **extra,
) -> dict:
    """``transformer_layer_config``: an HF config of the drafter's decoder layers."""
    return {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **extra,
    }


def shared_layer_config(cfg, *, model_type: str, num_layers: int, **extra) -> dict:
    """:func:`layer_config` from a drafter config dataclass with the fields both kinds share."""
    return layer_config(
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        **extra,
    )


def shared_config_fields(config: dict) -> dict:
    """The drafter config fields both kinds read back from ``config.json`` (the inverse of
    :func:`shared_layer_config` plus ``draft_vocab_size``)."""
    layer = config["transformer_layer_config"]
    vocab = int(layer["vocab_size"])
    return {
        "hidden_size": int(layer["hidden_size"]),
        "intermediate_size": int(layer["intermediate_size"]),
        "num_heads": int(layer["num_attention_heads"]),
        "num_kv_heads": int(layer["num_key_value_heads"]),
        "head_dim": int(
            layer.get("head_dim") or int(layer["hidden_size"]) // int(layer["num_attention_heads"])
        ),
        "vocab_size": vocab,
        "draft_vocab_size": int(config.get("draft_vocab_size") or vocab),
        "rms_norm_eps": float(layer["rms_norm_eps"]),
        "rope_theta": float(layer["rope_parameters"]["rope_theta"]),
        "max_position_embeddings": int(layer["max_position_embeddings"]),
    }


def envelope(
    *,
    model_type: str,
    architecture: str,
    speculative_tokens: int,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    transformer_layer_config: dict,
    dtype: torch.dtype,
    fields: dict,
) -> dict:
    if not verifier_name_or_path:
        raise ValueError("verifier_name_or_path is required (vLLM serves that model as the target)")
    return {
        "architectures": [architecture],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "torch_dtype": dtype_name(dtype),
        **fields,
        "speculators_config": {
            "algorithm": model_type,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "name_or_path": str(verifier_name_or_path),
                "architectures": list(verifier_architectures),
            },
        },
        "transformer_layer_config": transformer_layer_config,
    }


def export_weights(
    state: dict[str, Tensor], *, dtype: torch.dtype, identity_vocab: bool, include_embeddings: bool
) -> dict[str, Tensor]:
    """The tensors of model.safetensors: vLLM names, floats cast to ``dtype``."""
    out = {}
    for name, tensor in state.items():
        if name == "embed_tokens.weight" and not include_embeddings:
            continue
        if name in ("d2t", "t2d"):
            if identity_vocab:
                continue
            out[name] = tensor.detach().cpu().to(torch.int64 if name == "d2t" else torch.bool).contiguous()
            continue
        out[name] = tensor.detach().cpu().to(dtype).contiguous()
    return out


def write_folder(out_dir: str | Path, config: dict, tensors: dict[str, Tensor]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / EXPORT_WEIGHTS), metadata={"format": "pt"})
    (out / EXPORT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_config(folder: str | Path, expected_type: str | None = None) -> dict:
    config = json.loads((Path(folder) / EXPORT_CONFIG).read_text())
    if expected_type is not None and config.get("speculators_model_type") != expected_type:
        raise ValueError(
            f"{folder}: speculators_model_type is {config.get('speculators_model_type')!r}, "
            f"expected {expected_type!r}"
        )
    return config


def checkpoint_digest(folder: str | Path) -> str:
    """sha256 over what a checkpoint *is*: the files vLLM reads and the training record.

    An evaluation report records it, and publishing refuses a folder whose digest differs
    (the report measured other bytes). Files published beside them (card, chart) are not part of it.
    """
    h = hashlib.sha256()
    for name in (EXPORT_CONFIG, EXPORT_WEIGHTS, PROVENANCE):
        path = Path(folder) / name
        if not path.is_file():
            continue
        h.update(name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def model_type(config: dict) -> str | None:
    """The drafter kind a config.json declares (``speculators_model_type``)."""
    return config.get("speculators_model_type")


def speculative_tokens(config: dict) -> int | None:
    """The draft length vLLM uses: ``speculators_config.proposal_methods[0].speculative_tokens``."""
    try:
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def verifier(config: dict) -> str | None:
    """The target model the drafter was exported for (``speculators_config.verifier.name_or_path``)."""
    return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def read_folder(folder: str | Path, expected_type: str) -> tuple[dict, dict[str, Tensor]]:
    return read_config(folder, expected_type), load_file(str(Path(folder) / EXPORT_WEIGHTS))


def torch_dtype(config: dict) -> torch.dtype:
    return _DTYPES.get(config.get("torch_dtype", "float32"), torch.float32)


def fill_missing(tensors: dict[str, Tensor], config: dict, target: str | Path | None) -> dict[str, Tensor]:
    """Add embed_tokens from the verifier (as vLLM does) and an identity vocab when absent."""
    out = dict(tensors)
    if "embed_tokens.weight" not in out:
        out["embed_tokens.weight"] = load_embeddings(target or verifier(config))
    vocab = int(config["transformer_layer_config"]["vocab_size"])
    if "d2t" not in out:
        out["d2t"] = torch.zeros(vocab, dtype=torch.long)
        out["t2d"] = torch.ones(vocab, dtype=torch.bool)
    elif "t2d" not in out:
        ids = torch.arange(out["d2t"].numel()) + out["d2t"]
        out["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    return out
