"""Eagle3 checkpoints in the speculators format vLLM serves, and back.

vLLM 0.32 reads (``algos.update_eagle3`` + ``llama_eagle3.py``):
- ``eagle_aux_hidden_state_layer_ids`` (extraction convention: id k = residual stream
  entering target layer k), ``norm_before_residual`` (vLLM's default when absent: true),
  ``draft_vocab_size``, ``target_hidden_size``; ``speculative_tokens`` = chain length.
- ``transformer_layer_config``: a 1-layer ``llama`` config. It also carries
  ``num_aux_hidden_states``: ``Eagle3LlamaForCausalLM`` sizes ``fc`` from that field (or
  ``eagle_config``), else assumes 3 aux layers, and the top-level layer-id list is not
  consulted for it.
- Weights ``fc``, ``layers.0.{hidden_norm,input_layernorm,post_attention_layernorm}``,
  ``layers.0.self_attn.{q,k,v,o}_proj`` (q/k/v take 2H), ``layers.0.mlp.*``, ``norm``,
  ``lm_head``, ``d2t``/``t2d``; no ``model.`` prefix.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftflow.models import speculators
from draftflow.models.eagle3.config import Eagle3Config
from draftflow.models.eagle3.model import Eagle3Drafter
from draftflow.models.vocab import DraftVocab

ARCHITECTURE = "Eagle3Speculator"


def build_config(model: Eagle3Drafter, *, verifier_name_or_path: str, verifier_architectures: list[str],
                 aux_layer_ids: list[int], speculative_tokens: int, dtype: torch.dtype) -> dict:
    cfg = model.config
    ids = speculators.check_aux_layer_ids(aux_layer_ids, cfg.num_aux_layers)
    if speculative_tokens < 1:
        raise ValueError("speculative_tokens must be >= 1")
    layer_cfg = speculators.layer_config(
        model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=1, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        num_aux_hidden_states=cfg.num_aux_layers,
    )
    return speculators.envelope(
        model_type="eagle3", architecture=ARCHITECTURE, speculative_tokens=speculative_tokens,
        verifier_name_or_path=verifier_name_or_path, verifier_architectures=verifier_architectures,
        transformer_layer_config=layer_cfg, dtype=dtype,
        fields={
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.hidden_size,
            "norm_before_residual": cfg.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": ids,
        },
    )


def export(model: Eagle3Drafter, out_dir: str | Path, *, verifier_name_or_path: str,
           verifier_architectures: list[str], aux_layer_ids: list[int], speculative_tokens: int,
           dtype: torch.dtype | None = None, include_embeddings: bool = False) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``vllm serve out_dir`` loads."""
    dtype = dtype or model.fc.weight.dtype
    config = build_config(model, verifier_name_or_path=verifier_name_or_path,
                          verifier_architectures=verifier_architectures, aux_layer_ids=aux_layer_ids,
                          speculative_tokens=speculative_tokens, dtype=dtype)
    tensors = speculators.export_weights(model.state_dict(), dtype=dtype, identity_vocab=model.vocab.is_identity,
                                         include_embeddings=include_embeddings)
    return speculators.write_folder(out_dir, config, tensors)


def config_from_file(config: dict) -> Eagle3Config:
    layer = config["transformer_layer_config"]
    vocab = int(layer["vocab_size"])
    return Eagle3Config(
        hidden_size=int(layer["hidden_size"]),
        intermediate_size=int(layer["intermediate_size"]),
        num_heads=int(layer["num_attention_heads"]),
        num_kv_heads=int(layer["num_key_value_heads"]),
        head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // int(layer["num_attention_heads"])),
        vocab_size=vocab,
        draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
        num_aux_layers=len(config["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_theta=float(layer["rope_parameters"]["rope_theta"]),
        max_position_embeddings=int(layer["max_position_embeddings"]),
        norm_before_residual=bool(config.get("norm_before_residual", True)),
    )


def load(folder: str | Path, *, target: str | Path | None = None, dtype: torch.dtype | None = None) -> Eagle3Drafter:
    """Rebuild the drafter from an exported folder (embeddings from ``target`` or the verifier
    named in the config when the folder does not ship them)."""
    config, tensors = speculators.read_folder(folder, "eagle3")
    tensors = speculators.fill_missing(tensors, config, target)
    model = Eagle3Drafter(config_from_file(config), DraftVocab(tensors["d2t"], tensors["t2d"]))
    model.load_state_dict(tensors, strict=True)
    return model.to(dtype or speculators.torch_dtype(config))


def aux_layer_ids(folder: str | Path) -> list[int]:
    return list(speculators.read_config(folder, "eagle3")["eagle_aux_hidden_state_layer_ids"])


def speculative_tokens(folder: str | Path) -> int:
    methods = speculators.read_config(folder, "eagle3")["speculators_config"]["proposal_methods"]
    return int(methods[0]["speculative_tokens"])
