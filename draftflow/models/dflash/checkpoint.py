"""DFlash checkpoints in the speculators format vLLM serves, and back.

vLLM 0.32 reads (``algos.update_dflash`` + ``qwen3_dflash.py``):
- ``aux_hidden_state_layer_ids`` in the extraction convention (id k = residual stream
  entering target layer k); vLLM derives its own ``target_layer_ids = id - 1``.
- ``mask_token_id`` → the token fed to slots 1..B-1; ``speculative_tokens = block_size - 1``.
- ``transformer_layer_config``: a ``qwen3`` config (q/k norm, RoPE ``rope_parameters``);
  ``sliding_window_non_causal`` absent → non-causal blocks.
- Weights ``fc``, ``hidden_norm``, ``norm``, ``layers.i.*``, ``lm_head``, ``d2t``/``t2d`` with
  no ``model.`` prefix (vLLM prepends it to everything but lm_head and d2t).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftflow.models import speculators
from draftflow.models.dflash.config import DFlashConfig
from draftflow.models.dflash.model import DFlashDrafter
from draftflow.models.vocab import DraftVocab

ARCHITECTURE = "DFlashSpeculator"


def build_config(model: DFlashDrafter, *, verifier_name_or_path: str, verifier_architectures: list[str],
                 aux_layer_ids: list[int], dtype: torch.dtype) -> dict:
    cfg = model.config
    ids = speculators.check_aux_layer_ids(aux_layer_ids, cfg.num_context_layers)
    layer_cfg = speculators.layer_config(
        model_type="qwen3", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings, use_sliding_window=False,
    )
    return speculators.envelope(
        model_type="dflash", architecture=ARCHITECTURE, speculative_tokens=cfg.speculative_tokens,
        verifier_name_or_path=verifier_name_or_path, verifier_architectures=verifier_architectures,
        transformer_layer_config=layer_cfg, dtype=dtype,
        fields={
            "block_size": cfg.block_size,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.hidden_size,
            "mask_token_id": cfg.mask_token_id,
            "aux_hidden_state_layer_ids": ids,
        },
    )


def export(model: DFlashDrafter, out_dir: str | Path, *, verifier_name_or_path: str,
           verifier_architectures: list[str], aux_layer_ids: list[int], dtype: torch.dtype | None = None,
           include_embeddings: bool = False) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``vllm serve out_dir`` loads.

    dtype: weight dtype on disk (default: the model's). include_embeddings: also ship the
    (frozen, target) embedding; vLLM shares the target's when it is absent or identical.
    """
    dtype = dtype or model.fc.weight.dtype
    config = build_config(model, verifier_name_or_path=verifier_name_or_path,
                          verifier_architectures=verifier_architectures, aux_layer_ids=aux_layer_ids, dtype=dtype)
    tensors = speculators.export_weights(model.state_dict(), dtype=dtype, identity_vocab=model.vocab.is_identity,
                                         include_embeddings=include_embeddings)
    return speculators.write_folder(out_dir, config, tensors)


def config_from_file(config: dict) -> DFlashConfig:
    layer = config["transformer_layer_config"]
    vocab = int(layer["vocab_size"])
    return DFlashConfig(
        hidden_size=int(layer["hidden_size"]),
        intermediate_size=int(layer["intermediate_size"]),
        num_layers=int(layer["num_hidden_layers"]),
        num_heads=int(layer["num_attention_heads"]),
        num_kv_heads=int(layer["num_key_value_heads"]),
        head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // int(layer["num_attention_heads"])),
        vocab_size=vocab,
        draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
        num_context_layers=len(config["aux_hidden_state_layer_ids"]),
        block_size=int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]) + 1,
        mask_token_id=int(config["mask_token_id"]),
        rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_theta=float(layer["rope_parameters"]["rope_theta"]),
        max_position_embeddings=int(layer["max_position_embeddings"]),
    )


def load(folder: str | Path, *, target: str | Path | None = None, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Rebuild the drafter from an exported folder (embeddings from ``target`` or the verifier
    named in the config when the folder does not ship them)."""
    config, tensors = speculators.read_folder(folder, "dflash")
    tensors = speculators.fill_missing(tensors, config, target)
    model = DFlashDrafter(config_from_file(config), DraftVocab(tensors["d2t"], tensors["t2d"]))
    model.load_state_dict(tensors, strict=True)
    return model.to(dtype or speculators.torch_dtype(config))


def aux_layer_ids(folder: str | Path) -> list[int]:
    """The target layer ids (extraction convention) the drafter in ``folder`` reads."""
    return list(speculators.read_config(folder, "dflash")["aux_hidden_state_layer_ids"])
