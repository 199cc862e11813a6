"""The drafter a recipe asks for: built from the target, trained by one loss, exported.

The drafter kind's algorithm object (:mod:`draftflow.models`) does the kind-specific work;
the loop sees a model and a loss function.
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from draftflow.data.dataset import load_token_counts
from draftflow.models import algorithm_class
from draftflow.models.algorithm import DrafterAlgorithm
from draftflow.models.common import PackedBatch
from draftflow.models.losses import LossOutput
from draftflow.models.provenance import write_provenance
from draftflow.models.target_weights import TargetHead
from draftflow.models.vocab import (
    CorruptDraftVocab,
    DraftVocab,
    build_draft_vocab,
    counts_tensor,
    load_draft_vocab,
    save_draft_vocab,
)
from draftflow.paths import EXPORT_COMMAND, EXPORT_RECIPE
from draftflow.plan import Plan
from draftflow.recipe.redact import redact_args, redact_override, redacted_recipe
from draftflow.train.batches import LayerSelection

log = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, PackedBatch, torch.Generator | None], LossOutput]


@dataclass
class DrafterSetup:
    model: nn.Module
    loss_fn: LossFn
    layers: LayerSelection
    with_last: bool
    vocab: DraftVocab | None
    mask_token_id: int | None
    algorithm: DrafterAlgorithm

    def to(self, device: torch.device) -> nn.Module:
        """The model on ``device`` with what its loss reads there too (the target head for the
        ``target_logits`` loss); head rows it shares with the model stay shared."""
        head = self.algorithm.settings.target_head if self.algorithm.settings else None
        lm_head = getattr(self.model, "lm_head", None)
        shared = head is not None and lm_head is not None and head.shares_rows_with(lm_head.weight)
        model = self.model.to(device)
        if head is not None:
            if shared:
                head.head = model.lm_head.weight.detach()
            head.to(device)
        return model


def layer_selection(plan: Plan) -> LayerSelection:
    ids = list(plan.layer_ids)
    last = plan.target.num_layers
    return LayerSelection(
        context=tuple(ids.index(i) for i in plan.context_layer_ids),
        last=ids.index(last) if last in ids else None,
    )


def draft_vocab(
    plan: Plan, *, storage_options: dict | None = None, write_cache: bool = True
) -> DraftVocab | None:
    """The top-k vocabulary over loss-masked train tokens, cached per size and data fingerprint."""
    size = plan.recipe.drafter.draft_vocab_size
    if size is None or size >= plan.target.vocab_size:
        return None
    path = plan.data.draft_vocab(size)
    try:
        return load_draft_vocab(
            path, draft_vocab_size=size, fingerprint=plan.fingerprint, storage_options=storage_options
        )
    except FileNotFoundError:
        pass
    except CorruptDraftVocab as err:  # derived data: rebuilt from the (checksummed) token counts
        log.warning("%s", err)
    counts = counts_tensor(load_token_counts(plan.data, storage_options), plan.target.vocab_size)
    vocab = build_draft_vocab(counts, plan.target.vocab_size, size)
    if write_cache:
        save_draft_vocab(vocab, path, fingerprint=plan.fingerprint, storage_options=storage_options)
    return vocab


class WarmStartMismatch(ValueError):
    """The drafter to start from is not the shape the recipe builds."""


def build(
    plan: Plan,
    *,
    storage_options: dict | None = None,
    is_main: bool = True,
    init_from: str | Path | None = None,
) -> DrafterSetup:
    """The recipe's drafter, fresh, or with the weights and draft vocabulary of the exported folder
    ``init_from`` (a warm start: a refresh continues from the drafter in service)."""
    training = plan.recipe.training
    layers = layer_selection(plan)
    with_last = training.loss == "target_logits"
    warm = _warm_tensors(plan, init_from) if init_from is not None else None
    if warm is not None:
        vocab = _warm_vocab(plan, warm, init_from)
    else:
        vocab = draft_vocab(plan, storage_options=storage_options, write_cache=is_main)
    head = TargetHead.from_pretrained(plan.target_model, vocab) if with_last else None
    # Every rank must start from the same weights: seed the initialisation itself.
    torch.manual_seed(training.seed)
    drafter = algorithm_class(plan.recipe.drafter.kind).build(
        plan.recipe, plan.target_model, num_context_layers=len(layers.context), vocab=vocab, target_head=head
    )
    if warm is not None:
        _load_warm(drafter.model, warm, init_from)
    lm_head = getattr(drafter.model, "lm_head", None)
    if head is not None and lm_head is not None:
        head.use_rows_of(lm_head.weight)

    def loss_fn(model, batch, generator):
        return drafter.loss(batch, generator)  # ``model`` is drafter.model, moved to the device in place

    return DrafterSetup(drafter.model, loss_fn, layers, with_last, vocab, drafter.mask_token_id, drafter)


def _warm_tensors(plan: Plan, folder: str | Path) -> dict[str, torch.Tensor]:
    from draftflow.models import speculators

    try:
        config, tensors = speculators.read_folder(folder, plan.recipe.drafter.kind)
    except (OSError, ValueError) as err:
        raise WarmStartMismatch(
            f"warm start from {folder}: not a {plan.recipe.drafter.kind} export ({err})"
        ) from err
    return speculators.fill_missing(tensors, config, plan.target_model)


def _warm_vocab(plan: Plan, tensors: dict[str, torch.Tensor], folder: str | Path) -> DraftVocab | None:
    """The warm drafter's draft vocabulary, which must be the size the recipe asks for."""
    wanted = plan.recipe.drafter.draft_vocab_size
    d2t = tensors.get("d2t")
    served = None if d2t is None else int(d2t.numel())
    if served != wanted:

        def size(n):
            return "the full vocabulary" if n is None else f"{n} tokens"

        raise WarmStartMismatch(
            f"warm start from {folder}: its draft vocabulary is {size(served)}, the recipe's "
            f"drafter.draft_vocab_size asks for {size(wanted)}; train from scratch with "
            "refresh.warm_start: false"
        )
    return None if d2t is None else DraftVocab(d2t, tensors["t2d"])


def _load_warm(model: nn.Module, tensors: dict[str, torch.Tensor], folder: str | Path) -> None:
    """Copy the exported weights into the freshly built model; every tensor must fit."""
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    wrong = sorted(k for k in set(own) & set(tensors) if own[k].shape != tensors[k].shape)
    if missing or unexpected or wrong:
        shapes = ", ".join(f"{k} {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}" for k in wrong[:3])
        raise WarmStartMismatch(
            f"warm start from {folder}: the drafter in service is not the shape this recipe builds "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes: {shapes or 'none'}); "
            "train from scratch with refresh.warm_start: false"
        )
    with torch.no_grad():
        for name, value in own.items():
            value.copy_(tensors[name].to(value.dtype))
    log.info("warm start: weights and draft vocabulary of %s", folder)


def export(setup: DrafterSetup, plan: Plan, out_dir: str | Path, *, command: list[str] | None = None) -> Path:
    """The speculators folder vLLM serves, plus the resolved recipe, command and provenance."""
    out = Path(out_dir)
    drafter = setup.algorithm
    drafter.export(
        out,
        verifier_name_or_path=plan.target_model,
        verifier_architectures=list(plan.target.architectures),
        aux_layer_ids=list(plan.context_layer_ids),
    )
    # The folder travels (Hub repo): launch env / extra_args secrets are redacted (recipe.redact).
    (out / EXPORT_RECIPE).write_text(yaml.safe_dump(redacted_recipe(plan.recipe), sort_keys=False))
    overrides = sum((["--set", redact_override(o)] for o in plan.overrides), [])
    default_command = [sys.executable, "-m", "draftflow.train", plan.recipe_path, *overrides]
    (out / EXPORT_COMMAND).write_text(shlex.join(redact_args(command) if command else default_command) + "\n")
    write_provenance(
        out,
        recipe_name=plan.recipe.name,
        fingerprint=plan.fingerprint,
        drafter=drafter.kind,
        verifier=plan.target_model,
        extracted_layer_ids=list(plan.layer_ids),
        aux_layer_ids=list(plan.context_layer_ids),
        mask_token_id=drafter.mask_token_id,
        draft_vocab_size=setup.vocab.draft_vocab_size if setup.vocab is not None else None,
        d2t=drafter.model.d2t if setup.vocab is not None else None,
        speculative_tokens=drafter.speculative_tokens,
        target_hidden_size=plan.target.hidden_size,
        target_vocab_size=plan.target.vocab_size,
    )
    return out
