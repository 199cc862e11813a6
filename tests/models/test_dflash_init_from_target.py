"""`drafter.init_from_target`: DFlash decoder layers start as the target's last layers."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from draftflow.models.dflash.model import DFlashDrafter


def build(target: Path, num_layers: int, init: bool) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter.from_target(
        target,
        num_layers=num_layers,
        block_size=4,
        mask_token_id=0,
        num_context_layers=2,
        init_from_target=init,
    )


def test_layers_are_copied_from_the_targets_last_layers(tiny_llama_dir: Path):
    target = load_file(str(tiny_llama_dir / "model.safetensors"))  # 4 layers
    drafter = build(tiny_llama_dir, 2, init=True)
    for i, target_layer in ((0, 2), (1, 3)):
        own = drafter.layers[i].state_dict()
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"):
            assert torch.equal(own[name], target[f"model.layers.{target_layer}.{name}"]), (i, name)
        norm = f"model.layers.{target_layer}.input_layernorm.weight"
        assert torch.equal(own["input_layernorm.weight"], target[norm])
        # Llama has no per-head q/k norms: the drafter's keep their initial ones
        assert torch.equal(own["self_attn.q_norm.weight"], torch.ones_like(own["self_attn.q_norm.weight"]))


def test_default_keeps_random_layers_and_the_copy_trains(tiny_llama_dir: Path):
    target = load_file(str(tiny_llama_dir / "model.safetensors"))
    fresh = build(tiny_llama_dir, 1, init=False).layers[0].state_dict()
    assert not torch.equal(fresh["self_attn.q_proj.weight"], target["model.layers.3.self_attn.q_proj.weight"])
    copied = build(tiny_llama_dir, 1, init=True)
    trainable = [n for n, p in copied.named_parameters() if p.requires_grad and n.startswith("layers.0.")]
    assert "layers.0.self_attn.q_proj.weight" in trainable  # a starting point, not frozen
