"""DFlash's fields of the speculators format vLLM serves, and the config read back from them.

vLLM 0.32 reads (``algos.update_dflash`` + ``qwen3_dflash.py``):
- ``aux_hidden_state_layer_ids`` in the extraction convention (id k = residual stream
  entering target layer k); vLLM derives its own ``target_layer_ids = id - 1``.
- ``mask_token_id`` → the token fed to the mask slots; vLLM ignores ``block_size`` and builds
  a block of ``speculative_tokens + 1`` slots (draftflow writes the trained block size and a
  draft length of at most ``block_size - 1``).
- ``transformer_layer_config``: a ``qwen3`` config (q/k norm, RoPE ``rope_parameters``);
  ``sliding_window_non_causal`` absent → non-causal blocks.
- Weights ``fc``, ``hidden_norm``, ``norm``, ``layers.i.*``, ``lm_head``, ``d2t``/``t2d`` with
  no ``model.`` prefix (vLLM prepends it to everything but lm_head and d2t).

The envelope shared with every kind (writing, reading, d2t/t2d) is
:mod:`draftflow.models.speculators`; :class:`~draftflow.models.dflash.algorithm.DFlash` exports.
"""

from __future__ import annotations

from draftflow.models import speculators
from draftflow.models.dflash.config import DFlashConfig

ARCHITECTURE = "DFlashSpeculator"
AUX_LAYER_IDS_KEY = "aux_hidden_state_layer_ids"


def config_fields(cfg: DFlashConfig, aux_layer_ids: list[int]) -> tuple[dict, dict]:
    """(top-level config.json fields, transformer_layer_config) of a DFlash drafter."""
    ids = speculators.check_aux_layer_ids(aux_layer_ids, cfg.num_context_layers)
    layer_cfg = speculators.shared_layer_config(
        cfg, model_type="qwen3", num_layers=cfg.num_layers, use_sliding_window=False
    )
    fields = {
        "block_size": cfg.block_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "mask_token_id": cfg.mask_token_id,
        AUX_LAYER_IDS_KEY: ids,
    }
    return fields, layer_cfg


def config_from_file(config: dict) -> DFlashConfig:
    return DFlashConfig(
        **speculators.shared_config_fields(config),
        num_layers=int(config["transformer_layer_config"]["num_hidden_layers"]),
        num_context_layers=len(config[AUX_LAYER_IDS_KEY]),
        # Older exports may lack block_size: vLLM's own reading (a block of the draft length + 1).
        block_size=int(config.get("block_size") or speculators.speculative_tokens(config) + 1),
        mask_token_id=int(config["mask_token_id"]),
    )
