"""Run vLLM's own drafter classes on one drafting step; print JSON. NOT a pytest module.

Executed by ``tests/models/test_vllm_parity.py`` with the vLLM virtualenv's interpreter
(``$DRAFTFLOW_HOME/vllm-venv/bin/python``); the project venv never imports vLLM.
No server is started: the script builds vLLM's engine config for an exported drafter folder,
instantiates ``DFlashQwen3ForCausalLM`` / ``Eagle3LlamaForCausalLM``, loads the folder's
weights with vLLM's loader, and runs one proposal the way vLLM's proposers do. Only the
paged-attention kernel is replaced, by an explicit softmax over what vLLM's KV cache holds
at that point (DFlash: the precomputed context K/V + the block, non-causal; Eagle3: every
key at a position <= the query's). Everything else (fc, norms, q/k norm, RoPE, context
K/V precompute, residual wiring, d2t mapping) is vLLM's code, including the normalisation of
the context keys, which on this CPU build is the draftflow vLLM plugin's (plugins/draftflow_vllm_cpu,
loaded by vLLM's engine config as in a server): the stock CPU kernel applies layer 0's ``k_norm``
to every layer (known defect, see speculators-format.md), so without the plugin a multi-layer
DFlash drafts differently here. The output also reports whether vLLM's method equals a per-layer
loop over each layer's own ``k_norm`` (``grouped_k_norm_ok``).

Usage: python vllm_reference.py DRAFTER_DIR INPUTS.pt OUT.json
INPUTS.pt: {"aux": [T, n*H] float32, "input_ids": [T], "next_token": int, "num_tokens": int}
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def softmax_attention(q, k, v, visible, nh, nkv, hd, scale):
    q = q.view(-1, nh, hd).float()
    k = k.view(-1, nkv, hd).float().repeat_interleave(nh // nkv, 1)
    v = v.view(-1, nkv, hd).float().repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(q.shape[0], nh * hd)


def main(folder: str, inputs_path: str, out_path: str) -> None:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    inputs = torch.load(inputs_path)
    aux, ids = inputs["aux"].float(), inputs["input_ids"].long()
    vc = EngineArgs(
        model=folder, dtype="float32", enforce_eager=True, max_model_len=512
    ).create_engine_config()
    hf = vc.speculative_config.draft_model_config.hf_config
    target_dir = vc.model_config.model
    weights = load_file(os.path.join(folder, "model.safetensors"))
    embed = load_file(os.path.join(target_dir, "model.safetensors"))["model.embed_tokens.weight"]
    with set_current_vllm_config(vc):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.float32)
        arch = hf.architectures[0]
        if arch == "DFlashDraftModel":
            from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM as cls
        else:
            from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM as cls
        model = cls(vllm_config=vc)
        model.load_weights(iter(weights.items()))
        process_weights_after_loading(model, vc.speculative_config.draft_model_config, torch.device("cpu"))
        model.model.embed_tokens.weight.data.copy_(embed)  # the proposer shares the target's
        nh, nkv = hf.num_attention_heads, hf.num_key_value_heads
        hd = getattr(hf, "head_dim", None) or hf.hidden_size // nh
        scale = hd**-0.5
        with torch.no_grad():
            result = (
                run_dflash(model, aux, ids, inputs, nh, nkv, hd, scale)
                if arch == "DFlashDraftModel"
                else run_eagle3(model, aux, ids, inputs, nh, nkv, hd, scale)
            )
    result["architecture"] = arch
    with open(out_path, "w") as f:
        json.dump(result, f)


def run_dflash(model, aux, ids, inputs, nh, nkv, hd, scale):
    t = ids.shape[0]
    positions = torch.arange(t)
    ctx = model.combine_hidden_states(aux)  # fc
    context_kv = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn.attn

        def capture(_attn, k, v, _cache, _slots, i=i):
            context_kv[i] = (k.reshape(t, nkv, hd).clone(), v.reshape(t, nkv, hd).clone())

        attn.impl.do_kv_cache_update = capture

        def forward(q, k, v, i=i):
            ck, cv = context_kv[i]
            keys = torch.cat([ck.reshape(t, -1), k], 0)
            values = torch.cat([cv.reshape(t, -1), v], 0)
            visible = torch.ones(q.shape[0], keys.shape[0], dtype=torch.bool)  # non-causal
            return softmax_attention(q, keys, values, visible, nh, nkv, hd, scale)

        attn.forward = forward
    stock = model.model._normalize_context_k

    def per_layer_k_norm(all_k):  # [L, num_ctx, nkv, hd]
        return torch.stack(
            [layer.self_attn.k_norm.forward_native(all_k[i]) for i, layer in enumerate(model.model.layers)]
        )

    probe = torch.randn(len(model.model.layers), t, nkv, hd)
    grouped_ok = torch.allclose(stock(probe), per_layer_k_norm(probe), atol=1e-5)
    model.model.precompute_and_store_context_kv(ctx, positions, torch.zeros(t, dtype=torch.long))
    b = inputs["num_tokens"] + 1
    block = torch.full((b,), model.model.mask_token_id, dtype=torch.long)
    block[0] = inputs["next_token"]
    hidden = model(input_ids=block, positions=t + torch.arange(b))  # last_pos + 1 + offset
    logits = model.compute_logits(hidden[1:])
    return {
        "drafts": logits.argmax(-1).tolist(),
        "logits": draft_columns(logits).tolist(),
        "mask_token_id": int(model.model.mask_token_id),
        "grouped_k_norm_ok": grouped_ok,
    }


def run_eagle3(model, aux, ids, inputs, nh, nkv, hd, scale):
    t = ids.shape[0]
    cache = {"pos": [], "k": [], "v": [], "q_pos": None}
    for layer in model.model.layers:

        def forward(q, k, v):
            cache["pos"].append(cache["q_pos"])
            cache["k"].append(k)
            cache["v"].append(v)
            kpos = torch.cat(cache["pos"])
            visible = kpos[None, :] <= cache["q_pos"][:, None]
            return softmax_attention(
                q, torch.cat(cache["k"]), torch.cat(cache["v"]), visible, nh, nkv, hd, scale
            )

        layer.self_attn.attn.forward = forward
    hidden = model.combine_hidden_states(aux)
    tokens = torch.cat([ids[1:], torch.tensor([inputs["next_token"]])])
    positions = torch.arange(t)
    drafts, step_logits = [], []
    for _ in range(inputs["num_tokens"]):
        cache["q_pos"] = positions
        normed, prenorm = model(input_ids=tokens, positions=positions, hidden_states=hidden)
        logits = model.compute_logits(normed[-1:])
        draft = logits.argmax(-1)
        drafts.append(int(draft))
        step_logits.append(draft_columns(logits)[0].tolist())
        tokens, positions, hidden = draft, positions[-1:] + 1, prenorm[-1:]
    return {"drafts": drafts, "logits": step_logits}


def draft_columns(logits):
    """vLLM scatters draft logits into the target vocab (-inf elsewhere); take them back out
    in draft-id order (draft ids are ascending target ids)."""
    keep = torch.isfinite(logits[0])
    return logits[:, keep]


if __name__ == "__main__":
    main(*sys.argv[1:4])
