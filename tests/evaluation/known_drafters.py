"""Real drafter checkpoints with constructed weights whose proposals are known in advance.

A drafter whose final norm weight is zero computes exactly-zero hidden states before its head,
so every draft-vocab logit is 0 and the greedy draft is draft id 0, whatever the context: it
always proposes one fixed target token. The draft vocabulary is chosen so that draft id 0 is
the token we want (draft ids are the selected target ids in ascending order; ``d2t`` maps
them back). Everything else is a normal export of draftflow.models, served by vLLM as is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftflow.models.dflash import DFlash, DFlashDrafter
from draftflow.models.eagle3 import Eagle3, Eagle3Drafter
from draftflow.models.provenance import write_provenance
from draftflow.models.vocab import DraftVocab
from draftflow.target import read_target_info


def layers_of(target: Path) -> tuple[list[int], list[int]]:
    """(extracted, aux) layer ids by the speculators convention: [2, L//2, L-3, L] and all but L."""
    info = read_target_info(str(target))
    extracted = info.default_layer_ids()
    return extracted, [i for i in extracted if i != info.num_layers]


def fixed_token_vocab(token_id: int, vocab_size: int, size: int = 64) -> DraftVocab:
    """A draft vocabulary whose draft id 0 is ``token_id`` (the smallest selected target id)."""
    return DraftVocab.from_target_ids(torch.arange(token_id, token_id + size), vocab_size)


def perturb(model, seed: int = 0, scale: float = 0.05):
    """Move trainable weights off their init, as training would (norms included)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else scale))
    return model


def provenance(
    folder: Path,
    model,
    *,
    kind: str,
    target: Path,
    speculative_tokens: int,
    mask_token_id: int | None = None,
    fingerprint: str = "test-fp",
) -> None:
    info = read_target_info(str(target))
    extracted, aux = layers_of(target)
    vocab = model.vocab
    write_provenance(
        folder,
        recipe_name="test",
        fingerprint=fingerprint,
        drafter=kind,
        verifier=str(target),
        extracted_layer_ids=extracted,
        aux_layer_ids=aux,
        mask_token_id=mask_token_id,
        draft_vocab_size=None if vocab.is_identity else vocab.draft_vocab_size,
        d2t=None if vocab.is_identity else vocab.d2t,
        speculative_tokens=speculative_tokens,
        target_hidden_size=info.hidden_size,
        target_vocab_size=info.vocab_size,
    )


def _vocab(target: Path, fixed_token: int | None, draft_vocab_size: int | None) -> DraftVocab | None:
    vocab_size = read_target_info(str(target)).vocab_size
    if fixed_token is not None:
        return fixed_token_vocab(fixed_token, vocab_size)
    if draft_vocab_size is not None:  # every 3rd token: an arbitrary but valid reduced vocabulary
        return DraftVocab.from_target_ids(torch.arange(draft_vocab_size) * 3, vocab_size)
    return None


def _always_fixed(model, fixed_token: int | None):
    if fixed_token is not None:
        with torch.no_grad():
            model.norm.weight.zero_()  # zero hidden → all-zero logits → draft id 0 → fixed_token
    return model


def dflash_checkpoint(
    target: Path,
    out: Path,
    *,
    fixed_token: int | None = None,
    block_size: int = 4,
    num_layers: int = 1,
    mask_token_id: int = 0,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    fingerprint: str = "test-fp",
) -> Path:
    """A DFlash for ``target``: perturbed random weights, or one that always proposes ``fixed_token``."""
    _, aux = layers_of(target)
    model = DFlashDrafter.from_target(
        target,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        num_context_layers=len(aux),
        vocab=_vocab(target, fixed_token, draft_vocab_size),
    )
    model = _always_fixed(perturb(model, seed), fixed_token)
    folder = DFlash(model).export(
        out, verifier_name_or_path=str(target), verifier_architectures=["LlamaForCausalLM"], aux_layer_ids=aux
    )
    provenance(
        folder,
        model,
        kind="dflash",
        target=target,
        speculative_tokens=block_size - 1,
        mask_token_id=mask_token_id,
        fingerprint=fingerprint,
    )
    return folder


def eagle3_checkpoint(
    target: Path,
    out: Path,
    *,
    fixed_token: int | None = None,
    speculative_tokens: int = 3,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    fingerprint: str = "test-fp",
) -> Path:
    """An Eagle3 for ``target``: perturbed random weights, or one that always proposes ``fixed_token``."""
    _, aux = layers_of(target)
    model = Eagle3Drafter.from_target(
        target, num_aux_layers=len(aux), vocab=_vocab(target, fixed_token, draft_vocab_size)
    )
    model = _always_fixed(perturb(model, seed), fixed_token)
    folder = Eagle3(model, speculative_tokens=speculative_tokens).export(
        out, verifier_name_or_path=str(target), verifier_architectures=["LlamaForCausalLM"], aux_layer_ids=aux
    )
    provenance(
        folder,
        model,
        kind="eagle3",
        target=target,
        speculative_tokens=speculative_tokens,
        fingerprint=fingerprint,
    )
    return folder
