"""Fixtures for drafter tests: a packed batch of real hidden states from the tiny Llama target.

Tokens follow a fixed successor rule over a small token set (x_{t+1} = succ(x_t)), so the
next tokens are learnable and a drafter can overfit the batch quickly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from draftflow.models.common import PackedBatch
from draftflow.models.vocab import DraftVocab, build_draft_vocab

CONTEXT_LAYERS = [1, 2, 3]  # extraction ids (< L = 4): transformers' hidden_states[k]


@dataclass
class Synthetic:
    batch: PackedBatch
    vocab: DraftVocab
    logits: torch.Tensor  # [Bt, T, V] the target's logits (transformers)
    target_dir: str


def make_synthetic(
    target_dir,
    rows: int = 2,
    t: int = 64,
    docs: int = 2,
    seed: int = 0,
    n_tokens: int = 48,
    draft_vocab_size: int = 128,
) -> Synthetic:
    from transformers import LlamaForCausalLM

    g = torch.Generator().manual_seed(seed)
    tok = 1000 + torch.randperm(n_tokens, generator=g)
    succ = {int(tok[i]): int(tok[(i + 1) % n_tokens]) for i in range(n_tokens)}
    ids = torch.zeros(rows, t, dtype=torch.long)
    doc, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    length = t // docs
    for r in range(rows):
        for d in range(docs):
            x = int(tok[torch.randint(n_tokens, (1,), generator=g)])
            for i in range(d * length, (d + 1) * length):
                ids[r, i] = x
                x = succ[x]
            doc[r, d * length : (d + 1) * length] = d
            mask[r, d * length + length // 4 : (d + 1) * length] = 1  # "prompt" then "response"
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hook.remove()
    hidden = torch.stack([out.hidden_states[i] for i in CONTEXT_LAYERS], 2)  # [Bt, T, 3, H]
    counts = torch.bincount(ids.flatten(), minlength=model.config.vocab_size)
    vocab = build_draft_vocab(counts, model.config.vocab_size, draft_vocab_size)
    batch = PackedBatch(ids, hidden, mask, doc, None, captured["last"])
    return Synthetic(batch, vocab, out.logits, str(target_dir))


@pytest.fixture(scope="session")
def synthetic(tiny_llama_dir) -> Synthetic:
    return make_synthetic(tiny_llama_dir)
