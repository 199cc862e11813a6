"""``provenance.json``: how an exported drafter was trained, written beside ``config.json``.

The record holds the recipe and data fingerprint, the drafter kind, the verifier, the
extracted layer ids and the drafter's context ("aux") layer ids (extraction convention: id k =
residual stream entering target layer k), the mask token, the draft vocabulary (size and a
sha256 of ``d2t``), the draft length and the target's hidden and vocabulary sizes.
:mod:`draftflow.evaluation.contract` checks an export against it before it is published.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor

from draftflow.models import kinds
from draftflow.paths import PROVENANCE

PROVENANCE_FIELDS = (
    "recipe_name",
    "fingerprint",
    "drafter",
    "verifier",
    "extracted_layer_ids",
    "aux_layer_ids",
    "mask_token_id",
    "draft_vocab_size",
    "d2t_sha256",
    "speculative_tokens",
    "target_hidden_size",
    "target_vocab_size",
)


def d2t_digest(d2t: Tensor) -> str:
    """sha256 of the d2t tensor's bytes as stored (int64, little-endian, contiguous)."""
    return hashlib.sha256(d2t.detach().cpu().to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def write_provenance(folder: str | Path, *, d2t: Tensor | None = None, **fields) -> Path:
    """Write ``provenance.json`` into an export folder.

    Fields: :data:`PROVENANCE_FIELDS`; ``d2t`` (the tensor) may be given instead of
    ``d2t_sha256``. ``mask_token_id``, ``draft_vocab_size`` and ``d2t_sha256`` may be None
    (no mask token / full vocabulary).
    """
    if d2t is not None:
        fields["d2t_sha256"] = d2t_digest(d2t)
    for optional in ("mask_token_id", "draft_vocab_size", "d2t_sha256"):
        fields.setdefault(optional, None)
    missing = [f for f in PROVENANCE_FIELDS if f not in fields]
    unknown = [f for f in fields if f not in PROVENANCE_FIELDS]
    if missing or unknown:
        raise ValueError(f"provenance: missing fields {missing}, unknown fields {unknown}")
    if fields["drafter"] not in kinds():
        raise ValueError(f"provenance: drafter must be one of {kinds()}, not {fields['drafter']!r}")
    record = {f: fields[f] for f in PROVENANCE_FIELDS}
    for key in ("extracted_layer_ids", "aux_layer_ids"):
        record[key] = [int(i) for i in record[key]]
    record["verifier"] = str(record["verifier"])
    path = Path(folder) / PROVENANCE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_provenance(folder: str | Path) -> dict | None:
    path = Path(folder) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else None
