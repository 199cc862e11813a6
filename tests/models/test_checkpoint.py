"""Export → load roundtrips and the exact file contract vLLM 0.32 reads.

The required config fields and weight names below were read from vLLM 0.32's
``transformers_utils/configs/speculators/{base,algos}.py``, ``model_executor/models/
qwen3_dflash.py`` and ``llama_eagle3.py``; ``test_vllm_parity.py`` (slow) loads the same
folders with vLLM's own classes and loader.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from draftflow.models import load_drafter
from draftflow.models.dflash import DFlash, DFlashDrafter, dflash_loss, sample_anchors
from draftflow.models.eagle3 import Eagle3, Eagle3Drafter
from draftflow.paths import EXPORT_CONFIG, EXPORT_WEIGHTS

AUX = [1, 2, 3]
# base.validate_speculators_config: ValueError without these
REQUIRED_ALWAYS = ["speculators_model_type", "transformer_layer_config"]
# algos.update_dflash: config_dict["aux_hidden_state_layer_ids"], config_dict["mask_token_id"]
REQUIRED_DFLASH = ["mask_token_id", "aux_hidden_state_layer_ids"]
# algos.update_eagle3 reads these (defaults exist, but the values must be ours)
REQUIRED_EAGLE3 = [
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
    "draft_vocab_size",
    "target_hidden_size",
]
# fields the drafter classes read from the layer config
LAYER_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "hidden_act",
    "attention_bias",
]

LAYER_WEIGHTS_DFLASH = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]
LAYER_WEIGHTS_EAGLE3 = [
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


def expected_dflash_weights(num_layers: int, reduced: bool) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight"}
    names |= {f"layers.{i}.{w}" for i in range(num_layers) for w in LAYER_WEIGHTS_DFLASH}
    return names | ({"d2t", "t2d"} if reduced else set())


def expected_eagle3_weights(reduced: bool) -> set[str]:
    names = {"fc.weight", "norm.weight", "lm_head.weight"} | {f"layers.0.{w}" for w in LAYER_WEIGHTS_EAGLE3}
    return names | ({"d2t", "t2d"} if reduced else set())


def perturbed(model):
    """Move every trainable tensor off its init so a dropped or swapped weight shows."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * (0.2 if p.dim() == 1 else 0.02))
    return model


def dflash_model(synthetic, layers=2, vocab="reduced"):
    return perturbed(
        DFlashDrafter.from_target(
            synthetic.target_dir,
            num_layers=layers,
            block_size=4,
            mask_token_id=0,
            num_context_layers=3,
            vocab=synthetic.vocab if vocab == "reduced" else None,
        )
    )


def eagle3_model(synthetic, vocab="reduced", norm_before_residual=True):
    return perturbed(
        Eagle3Drafter.from_target(
            synthetic.target_dir,
            num_aux_layers=3,
            vocab=synthetic.vocab if vocab == "reduced" else None,
            norm_before_residual=norm_before_residual,
        )
    )


def weights_of(folder) -> dict[str, tuple]:
    with safe_open(str(folder / EXPORT_WEIGHTS), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def export(drafter, synthetic, folder, **kw):
    """``drafter`` exported for the synthetic target (layer ids AUX) into ``folder``."""
    return drafter.export(
        folder,
        verifier_name_or_path=synthetic.target_dir,
        verifier_architectures=["LlamaForCausalLM"],
        aux_layer_ids=AUX,
        **kw,
    )


def dflash_outputs(model, batch):
    start, end, _ = batch.documents()
    anchors = sample_anchors(batch.loss_mask, start, end, 4, 16, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = dflash_loss(model, batch, gamma=4.0, max_anchors=16, anchors=anchors)
        drafts = model.propose(batch.hidden_states[:, :40], batch.input_ids[:, 40])
    return out.loss, drafts


def eagle3_outputs(model, batch):
    start, _, pos = batch.documents()
    with torch.no_grad():
        outs = model.forward_ttt(batch.input_ids, batch.hidden_states, pos, start, 3)
        drafts = model.propose(
            batch.hidden_states[:, :40], batch.input_ids[:, :40], batch.input_ids[:, 40], 3
        )
    return torch.stack([model.compute_logits(o) for o in outs]), drafts


def test_dflash_export_file_contract(synthetic, tmp_path):
    model = dflash_model(synthetic)
    folder = export(DFlash(model), synthetic, tmp_path / "d")
    cfg = json.loads((folder / EXPORT_CONFIG).read_text())
    for key in REQUIRED_ALWAYS + REQUIRED_DFLASH:
        assert key in cfg, key
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == AUX
    spec = cfg["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3  # block_size - 1
    assert spec["verifier"] == {"name_or_path": synthetic.target_dir, "architectures": ["LlamaForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert all(k in layer for k in LAYER_FIELDS) and layer["model_type"] == "qwen3"
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": model.config.rope_theta}
    assert "sliding_window_non_causal" not in cfg  # absent = non-causal blocks in vLLM
    assert cfg["draft_vocab_size"] == 128 and cfg["target_hidden_size"] == 64 and cfg["mask_token_id"] == 0
    weights = weights_of(folder)
    assert set(weights) == expected_dflash_weights(2, reduced=True)
    assert weights["fc.weight"][0] == (64, 3 * 64) and weights["lm_head.weight"][0] == (128, 64)
    assert weights["d2t"] == ((128,), "I64") and weights["t2d"] == ((49152,), "BOOL")


def test_eagle3_export_file_contract(synthetic, tmp_path):
    model = eagle3_model(synthetic, norm_before_residual=False)
    folder = export(Eagle3(model, speculative_tokens=5), synthetic, tmp_path / "e")
    cfg = json.loads((folder / EXPORT_CONFIG).read_text())
    for key in REQUIRED_ALWAYS + REQUIRED_EAGLE3:
        assert key in cfg, key
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX and cfg["norm_before_residual"] is False
    layer = cfg["transformer_layer_config"]
    assert all(k in layer for k in LAYER_FIELDS) and layer["model_type"] == "llama"
    assert layer["num_hidden_layers"] == 1 and layer["num_aux_hidden_states"] == 3  # vLLM assumes 3 otherwise
    weights = weights_of(folder)
    assert set(weights) == expected_eagle3_weights(reduced=True)
    assert weights["layers.0.self_attn.q_proj.weight"][0] == (64, 128)  # 2H input
    assert weights["fc.weight"][0] == (64, 192)


def test_identity_vocab_ships_no_mapping_and_embeddings_are_optional(synthetic, tmp_path):
    model = dflash_model(synthetic, layers=1, vocab="identity")
    folder = DFlash(model).export(
        tmp_path / "d",
        verifier_name_or_path=synthetic.target_dir,
        verifier_architectures=["LlamaForCausalLM"],
        aux_layer_ids=AUX,
        include_embeddings=True,
    )
    weights = weights_of(folder)
    assert "d2t" not in weights and "t2d" not in weights and weights["lm_head.weight"][0] == (49152, 64)
    assert weights["embed_tokens.weight"][0] == (49152, 64)
    loaded = DFlash.load(folder).model
    assert loaded.vocab.is_identity
    torch.testing.assert_close(loaded.embed_tokens.weight, model.embed_tokens.weight, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_export_load_roundtrip_gives_identical_outputs(synthetic, tmp_path, kind):
    batch = synthetic.batch
    if kind == "dflash":
        model, outputs = dflash_model(synthetic), dflash_outputs
        drafter = DFlash(model)
    else:
        model, outputs = eagle3_model(synthetic), eagle3_outputs
        drafter = Eagle3(model, speculative_tokens=3)
    folder = export(drafter, synthetic, tmp_path / kind)
    reloaded = load_drafter(folder)  # embeddings come from the verifier named in config.json
    assert type(reloaded) is type(drafter) and reloaded.speculative_tokens == drafter.speculative_tokens
    loaded = reloaded.model
    assert type(loaded) is type(model) and loaded.config == model.config
    for a, b in zip(outputs(model, batch), outputs(loaded, batch)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # bf16 on disk: the loaded model is the bf16 cast of the original
    folder16 = export(drafter, synthetic, tmp_path / f"{kind}16", dtype=torch.bfloat16)
    assert json.loads((folder16 / EXPORT_CONFIG).read_text())["torch_dtype"] == "bfloat16"
    loaded16 = load_drafter(folder16).model
    assert loaded16.fc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded16.fc.weight, model.fc.weight.to(torch.bfloat16), rtol=0, atol=0)


def test_dflash_served_shorter_than_its_block_exports_and_loads_that_draft_length(synthetic, tmp_path):
    """Trained with blocks of 4, served with 1 drafted token: config.json keeps the trained block
    and says 1 (vLLM then builds blocks of 2); the reloaded drafter proposes 1 token, the same
    as a block-2 drafter with these weights, which is what vLLM runs."""
    from dataclasses import replace

    model = dflash_model(synthetic).eval()
    folder = export(DFlash(model, speculative_tokens=1), synthetic, tmp_path / "d1")
    cfg = json.loads((folder / EXPORT_CONFIG).read_text())
    assert cfg["block_size"] == 4
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 1
    assert DFlash.config_problems(cfg, AUX) == []
    reloaded = load_drafter(folder, dtype=torch.float32)
    assert reloaded.speculative_tokens == 1 and reloaded.model.config.block_size == 4
    short = DFlashDrafter(replace(model.config, block_size=2), model.vocab).eval()
    short.load_state_dict(model.state_dict())
    hidden, bonus = synthetic.batch.hidden_states[:, :9], synthetic.batch.input_ids[:, 9]
    _, served = reloaded.model.propose(hidden, bonus, num_tokens=1, return_logits=True)
    _, vllm_block = short.propose(hidden, bonus, return_logits=True)
    assert served.shape[1] == 1
    torch.testing.assert_close(served, vllm_block, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="drafts 1 to 3 tokens, not 4"):
        DFlash(model, speculative_tokens=4)
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 4
    assert DFlash.config_problems(cfg, AUX) == [
        "config.json block_size 4 drafts 1 to 3 tokens but speculative_tokens is 4"
    ]


def test_export_rejects_layer_ids_vllm_would_reorder_or_miscount(synthetic, tmp_path):
    model = dflash_model(synthetic, layers=1)
    common = dict(verifier_name_or_path=synthetic.target_dir, verifier_architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="ascending"):
        DFlash(model).export(tmp_path / "a", aux_layer_ids=[3, 1, 2], **common)
    with pytest.raises(ValueError, match="reads 3"):
        DFlash(model).export(tmp_path / "b", aux_layer_ids=[1, 2], **common)
    with pytest.raises(ValueError, match="verifier_name_or_path"):
        DFlash(model).export(
            tmp_path / "c", aux_layer_ids=AUX, verifier_name_or_path="", verifier_architectures=[]
        )
