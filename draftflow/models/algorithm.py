"""The one interface every drafter kind implements; trainer, evaluator, contract check and export
call it and never ask which kind they hold.

A kind is a subclass of :class:`DrafterAlgorithm` wrapping one ``nn.Module``:

- :meth:`~DrafterAlgorithm.build` a fresh drafter from the recipe and the target, and
  :meth:`~DrafterAlgorithm.load` one from an exported speculators folder;
- :meth:`~DrafterAlgorithm.loss` on a packed batch (training settings given at build);
- :meth:`~DrafterAlgorithm.propose` ``speculative_tokens`` drafts from a :class:`DraftState`;
- :meth:`~DrafterAlgorithm.export` the folder vLLM serves (the shared envelope is
  :mod:`draftflow.models.speculators`; a kind adds its own ``config.json`` fields);
- ``kind`` (= recipe ``drafter.kind`` = ``speculators_model_type``), ``aux_layer_ids_key`` (the
  ``config.json`` key of the target layers it reads) and kind-specific contract checks.

A kind's class lives in its package's ``algorithm`` module, decorated with
``@drafter_kind(section=ItsSection)``, which sets ``kind`` from the section;
:mod:`draftflow.models.registry` finds the package and imports that module when the kind is used.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from draftflow.models import speculators
from draftflow.models.common import PackedBatch
from draftflow.models.losses import LossOutput
from draftflow.models.vocab import DraftVocab


@dataclass
class DraftState:
    """What a proposer sees before one verification step."""

    prompt_index: int
    tokens: list[int]  # prompt + generated; tokens[-1] is the bonus token the target has not processed
    num_prompt_tokens: int
    aux_hidden: Tensor | None  # [len(tokens) - 1, n_aux, H] target states of the processed tokens

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens


@dataclass(frozen=True)
class TrainSettings:
    """What a drafter's loss needs beyond the batch: the recipe's drafter and training sections
    and, for the ``target_logits`` loss, the target's final norm + head."""

    drafter: Any  # the recipe's drafter section of this kind
    loss: str  # TrainingSection.loss
    target_head: nn.Module | None = None


class DrafterAlgorithm(ABC):
    """One drafter kind around its model; see the module doc."""

    kind: ClassVar[str]  # set by @drafter_kind from the section
    aux_layer_ids_key: ClassVar[str]
    architecture: ClassVar[str]  # config.json "architectures"

    def __init__(self, model: nn.Module, *, speculative_tokens: int, settings: TrainSettings | None = None):
        if speculative_tokens < 1:
            raise ValueError("speculative_tokens must be >= 1")
        self.model = model
        self.speculative_tokens = int(speculative_tokens)
        self.settings = settings

    # -- building --------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def build(
        cls,
        recipe,
        target_model: str,
        *,
        num_context_layers: int,
        vocab: DraftVocab | None,
        target_head: nn.Module | None = None,
    ) -> DrafterAlgorithm:
        """A fresh drafter for ``recipe`` (its drafter section is of this kind) reading
        ``num_context_layers`` target layers, weights shared with the target read from ``target_model``."""

    @classmethod
    def load(
        cls, folder: str | Path, *, target: str | Path | None = None, dtype: torch.dtype | None = None
    ) -> DrafterAlgorithm:
        """Rebuild the drafter exported in ``folder`` (embeddings from ``target`` or the verifier
        named in config.json when the folder does not ship them)."""
        config, tensors = speculators.read_folder(folder, cls.kind)
        tensors = speculators.fill_missing(tensors, config, target)
        model = cls.model_from_config(config, DraftVocab(tensors["d2t"], tensors["t2d"]))
        model.load_state_dict(tensors, strict=True)
        model = model.to(dtype or speculators.torch_dtype(config))
        return cls(model, speculative_tokens=speculators.speculative_tokens(config))

    @classmethod
    @abstractmethod
    def model_from_config(cls, config: dict, vocab: DraftVocab) -> nn.Module:
        """An (untrained) module shaped as the exported ``config.json`` says."""

    # -- training and drafting -------------------------------------------------------------

    @abstractmethod
    def loss(self, batch: PackedBatch, generator: torch.Generator | None = None) -> LossOutput:
        """The training loss of ``self.model`` on a packed batch (settings from :meth:`build`)."""

    @abstractmethod
    def propose(self, state: DraftState) -> list[int]:
        """``speculative_tokens`` target token ids that would follow ``state.tokens``, as vLLM drafts."""

    @property
    def mask_token_id(self) -> int | None:
        """The token fed to masked draft slots (recorded in provenance); None when the kind has none."""
        return None

    @property
    def vocab(self) -> DraftVocab:
        return self.model.vocab

    def _settings(self) -> TrainSettings:
        if self.settings is None:
            raise RuntimeError(
                f"{self.kind}: a drafter loaded from a checkpoint has no training settings; "
                "build it from a recipe to train it"
            )
        return self.settings

    # -- export ----------------------------------------------------------------------------

    @abstractmethod
    def config_fields(self, aux_layer_ids: list[int]) -> tuple[dict, dict]:
        """(kind-specific top-level config.json fields, ``transformer_layer_config``)."""

    def export(
        self,
        out_dir: str | Path,
        *,
        verifier_name_or_path: str,
        verifier_architectures: list[str],
        aux_layer_ids: list[int],
        dtype: torch.dtype | None = None,
        include_embeddings: bool = False,
    ) -> Path:
        """Write ``config.json`` + ``model.safetensors`` that ``vllm serve out_dir`` loads.

        dtype: weight dtype on disk (default: the model's). include_embeddings: also ship the
        (frozen, target) embedding; vLLM shares the target's when it is absent.
        """
        dtype = dtype or self.export_dtype()
        fields, layer_config = self.config_fields(list(aux_layer_ids))
        config = speculators.envelope(
            model_type=self.kind,
            architecture=self.architecture,
            speculative_tokens=self.speculative_tokens,
            verifier_name_or_path=verifier_name_or_path,
            verifier_architectures=verifier_architectures,
            transformer_layer_config=layer_config,
            dtype=dtype,
            fields=fields,
        )
        tensors = speculators.export_weights(
            self.model.state_dict(),
            dtype=dtype,
            identity_vocab=self.vocab.is_identity,
            include_embeddings=include_embeddings,
        )
        return speculators.write_folder(out_dir, config, tensors)

    def export_dtype(self) -> torch.dtype:
        """What :meth:`export` writes when given no dtype: the trained weights' (the first trainable
        parameter's; a frozen copy of target weights may be held in another dtype)."""
        params = [p for p in self.model.parameters() if p.is_floating_point()]
        if not params:
            raise ValueError(f"{self.kind}: the model has no floating-point weights to export")
        return next((p.dtype for p in params if p.requires_grad), params[0].dtype)

    # -- contract checks (kind-specific parts) ---------------------------------------------

    @classmethod
    def config_problems(cls, config: dict, aux_layer_ids: list[int]) -> list[str]:
        """What is inconsistent in this kind's own config.json fields."""
        return []

    @classmethod
    def provenance_problems(cls, config: dict, provenance: dict) -> list[str]:
        """What differs between this kind's config.json fields and the training record."""
        return []

    @classmethod
    def known_serving_issue(
        cls, config: dict, device: str, fixes: frozenset[str] = frozenset()
    ) -> str | None:
        """A defect of the vLLM build serving this checkpoint that changes its acceptance and that
        none of ``fixes`` (the defects the vLLM virtualenv's draftflow plugin fixes) removes."""
        return None
