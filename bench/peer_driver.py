"""The reference trainer's step (speculators 0.9.0), run by the peer virtualenv's python.

    <peer-venv>/bin/python bench/peer_driver.py FOLDER    # FOLDER written by peer_inputs.write_inputs

Imports speculators' own model classes (``DFlashDraftModel`` / ``Eagle3DraftModel``) and calls
their ``forward`` exactly as ``speculators.train.trainer`` does (anchors, masks, target
logits, KL loss and its reduction all inside the model), then backward and AdamW over the
trainable parameters. Only two things are pinned so both trainers do the same work:
- anchors: ``select_anchors`` draws its own random positions; it is replaced by one that
  returns the point's anchors (its signature and outputs unchanged);
- weights: the drafter starts from the same tensors as draftflow's (same parameter names),
  the frozen embedding / head / final norm are the point's target tensors.
Attention is speculators' ``sdpa`` path (its flex path needs a compiler and an accelerator;
``eager`` builds a float mask of the same size), the loss its ``eager`` KL (the fused one is
a Triton kernel). Imports nothing from draftflow. Prints one JSON line.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def _configs(meta: dict):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    common = dict(
        hidden_size=meta["hidden"],
        intermediate_size=meta["intermediate"],
        num_hidden_layers=1,
        num_attention_heads=meta["heads"],
        num_key_value_heads=meta["kv_heads"],
        head_dim=meta["head_dim"],
        vocab_size=meta["vocab"],
        rms_norm_eps=meta["rms_eps"],
        rope_theta=meta["rope_theta"],
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    if meta["kind"] == "dflash":
        from transformers import Qwen3Config

        layer_cfg = Qwen3Config(**common)
        tokens = meta["block"] - 1
    else:
        from transformers import LlamaConfig

        layer_cfg = LlamaConfig(**common)
        tokens = meta["ttt_steps"]
    layer_cfg._attn_implementation = "sdpa"
    spec = SpeculatorsConfig(
        algorithm=meta["kind"],
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
    )
    return layer_cfg, spec


def build_model(meta: dict, x: dict):
    layer_cfg, spec = _configs(meta)
    layer_ids = list(range(meta["context_layers"]))
    if meta["kind"] == "dflash":
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

        cfg = DFlashSpeculatorConfig(
            transformer_layer_config=layer_cfg,
            draft_vocab_size=meta["draft_vocab"],
            block_size=meta["block"],
            aux_hidden_state_layer_ids=layer_ids,
            mask_token_id=meta["mask_token"],
            speculators_config=spec,
        )
        model = DFlashDraftModel(cfg)
    else:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        cfg = Eagle3SpeculatorConfig(
            transformer_layer_config=layer_cfg,
            draft_vocab_size=meta["draft_vocab"],
            norm_before_residual=True,
            eagle_aux_hidden_state_layer_ids=layer_ids,
            speculators_config=spec,
        )
        model = Eagle3DraftModel(cfg)
    state = {k.removeprefix("drafter."): v for k, v in x.items() if k.startswith("drafter.")}
    state.update(
        {
            "embed_tokens.weight": x["embed"],
            "verifier_lm_head.weight": x["target_head"],
            "verifier_norm.weight": x["final_norm"],
            "t2d": x["t2d"],
            "d2t": x["d2t"],
        }
    )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise SystemExit(
            f"weights do not map onto speculators' model: missing={missing} unexpected={unexpected}"
        )
    model.train()
    return model


def pin_anchors(anchors: torch.Tensor) -> None:
    """speculators draws anchors with randperm inside ``select_anchors``: return the point's."""
    import speculators.models.dflash.core as core

    def select_anchors(loss_mask, num_anchors, block_size):
        assert num_anchors == anchors.numel()
        return anchors.clone(), torch.ones(num_anchors, dtype=torch.bool)

    core.select_anchors = select_anchors


def forward_kwargs(meta: dict, x: dict) -> dict:
    from speculators.losses import resolve_loss_config

    t = meta["seq"]
    loss = resolve_loss_config("kl_div", "eager")
    hidden = x["hidden_states"].flatten(-2)  # [1, T, n·H] as its data loader concatenates
    if meta["kind"] == "dflash":
        return dict(
            hidden_states=hidden,
            input_ids=x["input_ids"],
            loss_mask=x["loss_mask"],
            verifier_last_hidden_states=x["last_hidden"],
            document_ids=torch.zeros(1, t, dtype=torch.long),
            position_ids=torch.arange(t)[None],
            loss_config=loss,
            gamma=meta["gamma"],
            max_anchors=meta["anchors"],
        )
    # speculators.models.eagle3.data.shift_batch: pair state i with token i+1 and target state i+1
    return dict(
        hidden_states=hidden[:, :-1],
        input_ids=x["input_ids"][:, 1:],
        document_ids=torch.zeros(1, t - 1, dtype=torch.long),
        loss_mask=x["loss_mask"][:, 1:],
        position_ids=torch.arange(1, t)[None],
        verifier_last_hidden_states=x["last_hidden"][:, 1:],
        ttt_steps=meta["ttt_steps"],
        ttt_step_loss_decay=meta["ttt_decay"],
        loss_config=loss,
    )


def main(folder: Path) -> None:
    meta = json.loads((folder / "point.json").read_text())
    torch.set_num_threads(meta["threads"])
    x = load_file(str(folder / "inputs.safetensors"))
    model = build_model(meta, x)
    if meta["kind"] == "dflash":
        pin_anchors(x["anchors"])
    kwargs = forward_kwargs(meta, x)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=meta["lr"])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, cpu, losses = [], [], []
    for _ in range(1 + meta["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss, _metrics = model(**kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(float(loss.detach()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step_s = sum(times[1:]) / max(1, len(times) - 1)
    cpu_s = sum(cpu[1:]) / max(1, len(cpu) - 1)
    print(
        json.dumps(
            {
                "step_s": round(step_s, 4),
                "tokens_per_s": round(meta["seq"] / step_s, 1),
                "cpu_s": round(cpu_s, 4),
                "peak_rss_mb": round(peak / 1024, 1),
                "rss_growth_mb": round((peak - base) / 1024, 1),
                "first_loss": round(losses[0], 6),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
