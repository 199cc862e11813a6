"""Our drafters propose exactly what vLLM 0.32's own drafter classes propose.

For each case an exported folder is loaded by ``vllm_reference.py`` in the vLLM virtualenv
(a subprocess; no server, vLLM is never imported here): vLLM's engine config, its
``DFlashQwen3ForCausalLM`` / ``Eagle3LlamaForCausalLM`` and weight loader, one proposal as
its proposers run it (only the paged-attention kernel is swapped for an explicit softmax
over the KV cache). We compare drafts (exact) and draft-vocab logits (1e-4) with
:meth:`propose` of the model rebuilt by :func:`load_drafter` from the same folder.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from draftflow.models import load_drafter
from draftflow.models.dflash import DFlash, DFlashDrafter
from draftflow.models.eagle3 import Eagle3, Eagle3Drafter

REFERENCE = Path(__file__).with_name("vllm_reference.py")
CASES = {
    "dflash-2layers-reduced-vocab": dict(kind="dflash", layers=2, block=5, reduced=True),
    "dflash-1layer-full-vocab": dict(kind="dflash", layers=1, block=4, reduced=False),
    "eagle3-norm-before-residual-reduced-vocab": dict(kind="eagle3", nbr=True, reduced=True),
    "eagle3-norm-after-residual-full-vocab": dict(kind="eagle3", nbr=False, reduced=False),
}


def build(case: dict, synthetic, out: Path) -> Path:
    vocab = synthetic.vocab if case["reduced"] else None
    common = dict(
        verifier_name_or_path=synthetic.target_dir,
        verifier_architectures=["LlamaForCausalLM"],
        aux_layer_ids=[1, 2, 3],
    )
    gen = torch.Generator().manual_seed(1)
    if case["kind"] == "dflash":
        model = DFlashDrafter.from_target(
            synthetic.target_dir,
            num_layers=case["layers"],
            block_size=case["block"],
            mask_token_id=7,
            num_context_layers=3,
            vocab=vocab,
        )
    else:
        model = Eagle3Drafter.from_target(
            synthetic.target_dir, num_aux_layers=3, vocab=vocab, norm_before_residual=case["nbr"]
        )
    with torch.no_grad():  # trained-looking weights: norms away from 1, every layer distinct
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.05))
    if case["kind"] == "dflash":
        return DFlash(model).export(out, **common)
    return Eagle3(model, speculative_tokens=4).export(out, **common)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_proposals_match_vllm(name, synthetic, vllm_python, tmp_path):
    case = CASES[name]
    folder = build(case, synthetic, tmp_path / "drafter")
    batch, t = synthetic.batch, 40
    num_tokens = 4 if case["kind"] == "eagle3" else case["block"] - 1
    inputs = {
        "aux": batch.hidden_states[0, :t].flatten(-2),
        "input_ids": batch.input_ids[0, :t],
        "next_token": int(batch.input_ids[0, t]),
        "num_tokens": num_tokens,
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    result = subprocess.run(
        [vllm_python, str(REFERENCE), str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    ref = json.loads((tmp_path / "out.json").read_text())

    model = load_drafter(folder).model.eval()
    aux = batch.hidden_states[:1, :t]
    next_token = batch.input_ids[:1, t]
    if case["kind"] == "dflash":
        assert ref["architecture"] == "DFlashDraftModel" and ref["mask_token_id"] == 7
        drafts, logits = model.propose(aux, next_token, return_logits=True)
        # vLLM's own context-key normalisation (the draftflow vLLM plugin's, on this CPU build)
        # must equal each layer's k_norm: the stock CPU kernel applies layer 0's to every layer.
        hint = (
            ""
            if ref["grouped_k_norm_ok"]
            else " (vLLM's DFlash k_norm is not per layer: no draftflow vLLM plugin?)"
        )
        torch.testing.assert_close(
            logits[0], torch.tensor(ref["logits"]), rtol=0, atol=1e-4, msg=lambda m: m + hint
        )
        assert ref["grouped_k_norm_ok"]
    else:
        assert ref["architecture"] == "Eagle3LlamaForCausalLM"
        drafts, logits = model.propose(aux, batch.input_ids[:1, :t], next_token, 4, return_logits=True)
    assert drafts[0].tolist() == ref["drafts"]
    torch.testing.assert_close(logits[0], torch.tensor(ref["logits"]), rtol=0, atol=1e-4)
