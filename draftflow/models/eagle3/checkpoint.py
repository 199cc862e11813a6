"""Eagle3's fields of the speculators format vLLM serves, and the config read back from them.

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

The envelope shared with every kind (writing, reading, d2t/t2d) is
:mod:`draftflow.models.speculators`; :class:`~draftflow.models.eagle3.algorithm.Eagle3` exports.
"""

from __future__ import annotations

from draftflow.models import speculators
from draftflow.models.eagle3.config import Eagle3Config

ARCHITECTURE = "Eagle3Speculator"
AUX_LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


def config_fields(cfg: Eagle3Config, aux_layer_ids: list[int]) -> tuple[dict, dict]:
    """(top-level config.json fields, transformer_layer_config) of an Eagle3 drafter."""
    ids = speculators.check_aux_layer_ids(aux_layer_ids, cfg.num_aux_layers)
    layer_cfg = speculators.shared_layer_config(
        cfg, model_type="llama", num_layers=1, num_aux_hidden_states=cfg.num_aux_layers
    )
    fields = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        AUX_LAYER_IDS_KEY: ids,
    }
    return fields, layer_cfg


def config_from_file(config: dict) -> Eagle3Config:
    return Eagle3Config(
        **speculators.shared_config_fields(config),
        num_aux_layers=len(config[AUX_LAYER_IDS_KEY]),
        norm_before_residual=bool(config.get("norm_before_residual", True)),
    )
