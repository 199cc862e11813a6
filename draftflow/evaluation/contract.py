"""The contract between an exported checkpoint and how it was trained, checked before publishing.

The trainer writes ``provenance.json`` next to ``config.json``
(:func:`draftflow.models.provenance.write_provenance`): the recipe and data fingerprint, the
drafter kind, the verifier, the extracted and the aux layer ids, the mask token, the draft
vocabulary, the draft length and the target's hidden and vocabulary sizes.

:func:`check_contract` compares what vLLM will read (config.json, model.safetensors) with that
record and with itself, and returns one sentence per problem. The mistakes it is built for
change no shape and load fine, then silently ruin acceptance: layer ids shifted by one (the
"input of layer k" vs "output of layer k" confusion), a stale or foreign ``d2t``, another mask
token, another verifier, another draft length.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from draftflow.models import algorithm_class, kinds, speculators
from draftflow.models.provenance import d2t_digest, read_provenance
from draftflow.paths import EXPORT_CONFIG, EXPORT_WEIGHTS, PROVENANCE


class ContractError(ValueError):
    """The checkpoint does not match its training provenance (or itself)."""


def _shift_hint(found: list[int], trained: list[int]) -> str:
    if len(found) != len(trained) or not found:
        return ""
    deltas = {a - b for a, b in zip(found, trained)}
    if len(deltas) != 1:
        return ""
    delta = deltas.pop()
    return " (shifted by one?)" if abs(delta) == 1 else f" (shifted by {delta:+d}?)"


def _read_weights(folder: Path) -> tuple[dict[str, tuple[int, ...]], Tensor | None]:
    with safe_open(str(folder / EXPORT_WEIGHTS), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        d2t = f.get_tensor("d2t") if "d2t" in shapes else None
    return shapes, d2t


def _file_problems(config: dict, kind, aux: list[int], shapes: dict, d2t: Tensor | None) -> list[str]:
    """What is inconsistent inside the folder itself."""
    out = []
    layer = config.get("transformer_layer_config") or {}
    hidden, vocab = int(layer.get("hidden_size", 0)), int(layer.get("vocab_size", 0))
    fc = shapes.get("fc.weight")
    if fc is None:
        out.append("model.safetensors has no fc.weight")
    elif fc != (hidden, len(aux) * hidden):
        out.append(
            f"fc.weight shape {list(fc)} does not read the {len(aux)} aux layers {aux} of hidden size {hidden} "
            f"(expected {[hidden, len(aux) * hidden]})"
        )
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    head = shapes.get("lm_head.weight")
    if head is not None and head[0] != draft_vocab:
        out.append(f"lm_head.weight has {head[0]} rows but config.json draft_vocab_size is {draft_vocab}")
    if d2t is not None:
        if head is not None and d2t.numel() != head[0]:
            out.append(f"d2t has {d2t.numel()} entries but lm_head.weight has {head[0]} rows")
        ids = torch.arange(d2t.numel()) + d2t.long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            out.append(f"d2t maps draft ids outside the target vocabulary [0, {vocab})")
        elif ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            out.append("d2t target ids are not strictly increasing (a corrupt or hand-edited mapping)")
    elif head is not None and head[0] != vocab:
        out.append(f"lm_head.weight has {head[0]} rows (a reduced vocabulary) but there is no d2t mapping")
    return out + kind.config_problems(config, aux)


def _same_model(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a.rstrip("/") == b.rstrip("/")


def _provenance_problems(
    config: dict, kind, aux: list[int], shapes: dict, d2t: Tensor | None, prov: dict
) -> list[str]:
    """What differs between the folder and the training record."""
    out = []
    layer = config.get("transformer_layer_config") or {}
    if prov.get("drafter") != kind.kind:
        out.append(
            f"config.json speculators_model_type {kind.kind!r} != trained drafter {prov.get('drafter')!r}"
        )
    trained = [int(i) for i in prov.get("aux_layer_ids") or []]
    if aux != trained:
        out.append(
            f"config.json {kind.aux_layer_ids_key} {aux} != trained {trained}{_shift_hint(aux, trained)}"
        )
    extracted = [int(i) for i in prov.get("extracted_layer_ids") or []]
    if not set(trained) <= set(extracted):
        out.append(f"trained aux layers {trained} are not all among the extracted layers {extracted}")
    served = speculators.verifier(config)
    if served is None or not _same_model(served, str(prov.get("verifier"))):
        out.append(f"config.json verifier {served!r} != the target trained against {prov.get('verifier')!r}")
    spec = speculators.speculative_tokens(config)
    if spec != prov.get("speculative_tokens"):
        out.append(f"config.json speculative_tokens {spec} != trained {prov.get('speculative_tokens')}")
    out += kind.provenance_problems(config, prov)
    vocab = int(layer.get("vocab_size", 0))
    head_rows = (shapes.get("lm_head.weight") or (None,))[0]
    trained_vocab = prov.get("draft_vocab_size")
    if trained_vocab is not None and head_rows is not None and head_rows != trained_vocab:
        out.append(
            f"lm_head.weight has {head_rows} rows but the drafter was trained with draft_vocab_size "
            f"{trained_vocab}"
        )
    trained_digest = prov.get("d2t_sha256")
    if trained_digest is None and d2t is not None:
        out.append("model.safetensors ships a d2t mapping but the drafter was trained on the full vocabulary")
    elif trained_digest is not None:
        found = d2t_digest(d2t if d2t is not None else torch.zeros(vocab, dtype=torch.int64))
        if found != trained_digest:
            what = "d2t" if d2t is not None else "the identity vocabulary (no d2t)"
            out.append(
                f"model.safetensors {what} (sha256 {found[:12]}…) != the draft vocabulary used in training "
                f"(sha256 {trained_digest[:12]}…): a stale or foreign d2t mapping"
            )
    hidden = int(layer.get("hidden_size", 0))
    if prov.get("target_hidden_size") not in (None, hidden):
        out.append(f"drafter hidden size {hidden} != trained target_hidden_size {prov['target_hidden_size']}")
    if prov.get("target_vocab_size") not in (None, vocab):
        out.append(
            f"transformer_layer_config.vocab_size {vocab} != trained target_vocab_size "
            f"{prov['target_vocab_size']}"
        )
    return out


def _target_problems(config: dict, aux: list[int], target_info) -> list[str]:
    out = []
    layer = config.get("transformer_layer_config") or {}
    if int(layer.get("hidden_size", 0)) != target_info.hidden_size:
        out.append(
            f"drafter hidden size {layer.get('hidden_size')} != the target's {target_info.hidden_size}"
        )
    if int(layer.get("vocab_size", 0)) != target_info.vocab_size:
        out.append(f"drafter vocab_size {layer.get('vocab_size')} != the target's {target_info.vocab_size}")
    bad = [i for i in aux if not 0 <= i <= target_info.num_layers]
    if bad:
        out.append(
            f"aux layer ids {bad} outside 0..{target_info.num_layers} for a {target_info.num_layers}-layer "
            "target"
        )
    archs = ((config.get("speculators_config") or {}).get("verifier") or {}).get("architectures") or []
    if archs and target_info.architectures and set(archs).isdisjoint(target_info.architectures):
        out.append(
            f"config.json verifier architectures {archs} != the target's {list(target_info.architectures)}"
        )
    return out


def check_contract(
    folder: str | Path, target_info=None, *, verifier: str | None = None, fingerprint: str | None = None
) -> list[str]:
    """Problems of the export in ``folder``, one sentence each; empty when it is sound.

    target_info: the target's :class:`~draftflow.target.TargetInfo` (sizes, layer count);
    verifier: the target this checkpoint will be evaluated/served with; fingerprint: the data
    fingerprint of the recipe evaluating it (its held-out split is only held out for the
    checkpoint trained on that data).
    """
    folder = Path(folder)
    if not (folder / EXPORT_CONFIG).is_file() or not (folder / EXPORT_WEIGHTS).is_file():
        return [f"{folder}: not an exported checkpoint ({EXPORT_CONFIG} and {EXPORT_WEIGHTS} required)"]
    config = json.loads((folder / EXPORT_CONFIG).read_text())
    name = config.get("speculators_model_type")
    if name not in kinds():
        return [f"config.json speculators_model_type {name!r} is none of the drafter kinds {kinds()}"]
    kind = algorithm_class(name)
    key = kind.aux_layer_ids_key
    if key not in config:
        return [f"config.json has no {key} (vLLM needs the layers the drafter reads)"]
    aux = [int(i) for i in config[key]]
    problems = []
    if aux != sorted(set(aux)):
        problems.append(
            f"config.json {key} {aux} is not ascending and unique (vLLM sorts them; "
            "fc's input blocks would be read in another order)"
        )
    shapes, d2t = _read_weights(folder)
    problems += _file_problems(config, kind, aux, shapes, d2t)
    prov = read_provenance(folder)
    if prov is None:
        problems.append(
            f"no {PROVENANCE} in {folder}: the trainer's record is missing, so layer ids, draft "
            "vocabulary and mask token cannot be checked against training"
        )
    else:
        problems += _provenance_problems(config, kind, aux, shapes, d2t, prov)
        if fingerprint is not None and prov.get("fingerprint") != fingerprint:
            problems.append(
                f"checkpoint trained on data {prov.get('fingerprint')!r} but evaluated with recipe data "
                f"{fingerprint!r}: its eval split is not known to be held out for this checkpoint"
            )
    if target_info is not None:
        problems += _target_problems(config, aux, target_info)
    served = speculators.verifier(config)
    if verifier is not None and not _same_model(str(served), str(verifier)):
        problems.append(f"config.json verifier {served!r} != the target evaluated here {verifier!r}")
    return problems


def assert_contract(folder: str | Path, target_info=None, **kwargs) -> None:
    """Raise :class:`ContractError` listing every problem :func:`check_contract` finds."""
    problems = check_contract(folder, target_info, **kwargs)
    if problems:
        raise ContractError(f"{folder}: checkpoint contract broken:\n- " + "\n- ".join(problems))
