"""The reduced draft vocabulary: which target tokens a drafter's head can propose.

- Selection: the ``draft_vocab_size`` most frequent target tokens (counts over loss-masked
  training tokens), ties broken by the smaller token id, so the result is a pure function
  of the count table. Tokens never seen fill the remaining slots by ascending id.
- Draft ids are the selected target ids in ascending order, so ``d2t`` is non-decreasing.
- ``d2t[i] = target_id(i) - i`` (int64, ``[draft_vocab]``): ``target = i + d2t[i]``, the
  convention vLLM reads. ``t2d`` (bool, ``[target_vocab]``) marks the selected tokens.
- Caching is the caller's job (key: size + data fingerprint, see ``DataLayout.draft_vocab``);
  :func:`save_draft_vocab` records both in the file's metadata and :func:`load_draft_vocab`
  checks them when asked, so a stale mapping is an error rather than silent bad acceptance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftVocab:
    d2t: Tensor  # [draft_vocab] int64, target id = draft id + d2t
    t2d: Tensor  # [target_vocab] bool

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())

    @property
    def is_identity(self) -> bool:
        return self.draft_vocab_size == self.target_vocab_size

    def target_ids(self) -> Tensor:
        """[draft_vocab] the target id of every draft id."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_draft(self, target_ids: Tensor) -> Tensor:
        """Map target ids to draft ids; -1 where the token is not in the draft vocab."""
        lookup = torch.cumsum(self.t2d.long(), 0) - 1
        lookup = torch.where(self.t2d, lookup, torch.full_like(lookup, -1))
        return lookup.to(target_ids.device)[target_ids.clamp(0, self.target_vocab_size - 1)].masked_fill(
            (target_ids < 0) | (target_ids >= self.target_vocab_size), -1
        )

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    @classmethod
    def identity(cls, vocab_size: int) -> DraftVocab:
        return cls(torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool))

    @classmethod
    def from_target_ids(cls, target_ids: Tensor, target_vocab_size: int) -> DraftVocab:
        ids = torch.as_tensor(target_ids, dtype=torch.long)
        if ids.numel() == 0 or ids.unique().numel() != ids.numel():
            raise ValueError("draft vocab target ids must be non-empty and unique")
        if int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size:
            raise ValueError(f"draft vocab target ids must lie in [0, {target_vocab_size})")
        ids = ids.sort().values
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return cls(ids - torch.arange(ids.numel()), t2d)


def counts_tensor(counts: Mapping[int, int] | Sequence[int] | Tensor, target_vocab_size: int) -> Tensor:
    """A token_id→count table (dict, or counts indexed by id) as an int64 [target_vocab] tensor."""
    if isinstance(counts, Mapping):
        out = torch.zeros(target_vocab_size, dtype=torch.long)
        for token, count in counts.items():
            token = int(token)
            if not 0 <= token < target_vocab_size:
                raise ValueError(f"token id {token} outside the target vocab [0, {target_vocab_size})")
            if count < 0:
                raise ValueError(f"negative count for token {token}")
            out[token] += int(count)
        return out
    out = torch.as_tensor(counts, dtype=torch.long).flatten()
    if out.numel() > target_vocab_size:
        raise ValueError(f"{out.numel()} counts for a target vocab of {target_vocab_size}")
    if out.numel() and int(out.min()) < 0:
        raise ValueError("negative counts")
    return torch.cat([out, torch.zeros(target_vocab_size - out.numel(), dtype=torch.long)])


def build_draft_vocab(
    counts: Mapping[int, int] | Sequence[int] | Tensor, target_vocab_size: int, draft_vocab_size: int
) -> DraftVocab:
    """Top ``draft_vocab_size`` tokens by count (ties: smaller id first), as a DraftVocab."""
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {target_vocab_size}]")
    table = counts_tensor(counts, target_vocab_size)
    # Stable sort on descending count keeps ascending id order among equal counts.
    order = torch.sort(-table, stable=True).indices
    return DraftVocab.from_target_ids(order[:draft_vocab_size], target_vocab_size)


def save_draft_vocab(
    vocab: DraftVocab, path: str, *, fingerprint: str = "", storage_options: dict | None = None
) -> None:
    """Write d2t/t2d as safetensors (local path or fsspec URL) with size + fingerprint metadata."""
    from safetensors.torch import save

    from draftflow.data.dataset import atomic_write

    tensors = {"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}
    metadata = {
        "draft_vocab_size": str(vocab.draft_vocab_size),
        "target_vocab_size": str(vocab.target_vocab_size),
        "fingerprint": fingerprint,
        "tensors_sha256": _tensors_digest(tensors),
    }
    data = save(tensors, metadata=metadata)
    # Temp + rename (one complete object on object stores): a kill mid-write leaves the old
    # file or none, never a torn one that every later run would trip over.
    atomic_write(path, storage_options, lambda f: f.write(data))


def load_draft_vocab(
    path: str,
    *,
    draft_vocab_size: int | None = None,
    fingerprint: str | None = None,
    storage_options: dict | None = None,
) -> DraftVocab:
    """Read a saved mapping; raise if it was built for another size or other data."""
    import fsspec
    from safetensors.torch import load

    with fsspec.open(path, "rb", **(storage_options or {})) as f:
        data = f.read()
    try:
        tensors = load(data)
        metadata = _metadata(data)
    except Exception as err:  # a torn or garbled header
        raise CorruptDraftVocab(f"{path}: unreadable draft-vocab file ({err})") from None
    recorded = metadata.get("tensors_sha256")
    if recorded is None or recorded != _tensors_digest(tensors):
        raise CorruptDraftVocab(
            f"{path}: d2t/t2d do not match the sha256 recorded when the file was written"
            + (" (none recorded)" if recorded is None else "")
            + "; it is rebuilt from the token counts"
        )
    vocab = DraftVocab(tensors["d2t"].long(), tensors["t2d"].bool())
    if draft_vocab_size is not None and vocab.draft_vocab_size != draft_vocab_size:
        raise ValueError(
            f"{path}: draft vocab has {vocab.draft_vocab_size} tokens, expected {draft_vocab_size}"
        )
    if fingerprint is not None and metadata.get("fingerprint") != fingerprint:
        raise ValueError(f"{path}: built from data {metadata.get('fingerprint')!r}, expected {fingerprint!r}")
    return vocab


class CorruptDraftVocab(ValueError):
    """A cached draft-vocab file whose tensors are not the ones written (bit flip, torn write)."""


def _tensors_digest(tensors: Mapping[str, Tensor]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _metadata(data: bytes) -> dict:
    """The ``__metadata__`` of a safetensors byte string (8-byte header length, JSON header)."""
    import json
    import struct

    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    return header.get("__metadata__", {}) or {}
