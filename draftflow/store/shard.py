"""The shard format: many samples' hidden states in one safetensors object.

Layout of one shard (a valid safetensors file; ``safetensors.safe_open`` reads it)::

    u64 little-endian N | N bytes of JSON header, space-padded to an 8-byte boundary | data
    header: "__metadata__": {format, format_version, shard_id, writer, sample_ids (JSON), ...}
            "<i>.token_ids":     int32|int64 [T]            sample i's tensors are adjacent,
            "<i>.hidden_scales": bf16 [T, n_layers]         in this order, so one sample is
            "<i>.hidden_states": dtype [T, n_layers, H]     one contiguous byte range
            "<i>.loss_mask":     uint8 [T]
            "<i>.padding":       uint8 [p]  (p in 1..7, only when needed: next sample 8-aligned)

``hidden_scales`` exists only in FP8 shards (``dtype`` float8_e4m3 / float8_e5m2, see
:mod:`draftflow.store.fp8`): one scale per token and layer, between the token ids and the
values, so the manifest's offsets need no new columns (the scales are the bytes from the end
of the token ids to the start of the hidden states). Format version 2 added them; version-1
shards (no FP8) read unchanged.

Why this format:

* **Safetensors, not pickle.** It is a JSON header plus raw little-endian bytes: nothing is
  executed on load (``torch.load`` of a pickle can run code), every language can read it, and
  it is what vLLM itself writes, so one reader stack serves both.
* **Random access.** The header gives every tensor's byte offsets, and the manifest copies
  them, so reading one sample is a single range read of exactly its bytes — a seek on a local
  disk, one ``Range`` GET on S3 — without reading the header or the rest of the shard.
* **One contiguous range per sample** (token ids, hidden states, mask in a row) so a sample is
  one request and one per-sample checksum, not three.
* **Alignment.** The data section and every sample start on an 8-byte boundary and token ids
  come first (size a multiple of 4), so every tensor is aligned for its dtype and can be viewed
  without a copy from an mmap'd local shard.
* **Many samples per object.** Object stores charge per request and list slowly; one object
  per sample would mean millions of tiny objects. Shards of ``samples_per_shard`` samples are
  the unit of writing, checksumming, regeneration and garbage collection.
* **Self-describing.** The header metadata names the shard, its writer and its sample ids,
  so a shard can be identified (and a manifest rebuilt) from the object alone.
* **Streamed writing.** Offsets follow from the shapes alone, so the header is written first
  and tensors are streamed after it while the shard and per-sample SHA-256 are computed on
  the way: no second pass, no full copy of the shard in memory.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

import torch

from draftflow.store import fp8

FORMAT = "draftflow-shard"
FORMAT_VERSION = 2  # 2: FP8 hidden states with per-row scales

# Recipe dtype name -> (torch dtype, safetensors dtype code).
HIDDEN_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
    "float32": (torch.float32, "F32"),
}
TOKEN_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "int32": (torch.int32, "I32"),
    "int64": (torch.int64, "I64"),
}
MASK_DTYPE = (torch.uint8, "U8")
_ALIGN = 8


@dataclass(frozen=True)
class Sample:
    """One sample's tensors: written to a shard and returned by the readers."""

    sample_id: str
    hidden_states: torch.Tensor  # [T, n_layers, H]
    token_ids: torch.Tensor  # [T] int32 or int64
    loss_mask: torch.Tensor  # [T] uint8 (1 = the token is trained on)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class TensorSpan:
    """Absolute byte range of one tensor inside the shard object."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class SampleSpans:
    """Where one sample lives in its shard; ``start``/``end`` cover all its tensors."""

    token_ids: TensorSpan
    hidden_states: TensorSpan
    loss_mask: TensorSpan

    @property
    def start(self) -> int:
        return self.token_ids.offset

    @property
    def end(self) -> int:
        return self.loss_mask.end

    def hidden_scales(self, num_tokens: int, n_layers: int) -> TensorSpan:
        """FP8 shards: the bf16 scales, which fill the gap between token ids and hidden states."""
        span = TensorSpan(self.token_ids.end, self.hidden_states.offset - self.token_ids.end)
        expected = num_tokens * n_layers * fp8.SCALE_DTYPE[0].itemsize
        if span.length != expected:
            raise ValueError(f"FP8 sample has {span.length} bytes of scales where {expected} belong")
        return span


def as_stored(hidden: torch.Tensor, dtype: str) -> torch.Tensor:
    """``hidden`` as a read of a shard of ``dtype`` returns it (FP8: quantised, decoded in fp32)."""
    if fp8.is_fp8(dtype):
        return fp8.fake_quantise(hidden, dtype)
    return hidden.to(HIDDEN_DTYPES[dtype][0])


def stored_dtypes() -> list[str]:
    """Every ``extraction.dtype`` the shard format can hold."""
    return [*HIDDEN_DTYPES, *fp8.FP8_FORMATS]


@dataclass(frozen=True)
class WrittenShard:
    """What streaming a shard produced: sizes, offsets and checksums for the manifest."""

    nbytes: int
    sha256: str
    spans: tuple[SampleSpans, ...]
    sample_sha256: tuple[str, ...]


def token_dtype_name(dtype: torch.dtype) -> str:
    for name, (torch_dtype, _) in TOKEN_DTYPES.items():
        if torch_dtype == dtype:
            return name
    raise ValueError(f"token ids must be int32 or int64, got {dtype}")


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, little-endian, without a copy when it is already contiguous on CPU."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _prepare(
    sample: Sample, dtype: str, n_layers: int, hidden_size: int
) -> list[tuple[str, str, list[int], memoryview]]:
    """Check one sample and return its tensors as (suffix, code, shape, bytes), in file order."""
    hidden, tokens, mask = sample.hidden_states, sample.token_ids, sample.loss_mask
    if hidden.ndim != 3 or tuple(hidden.shape[1:]) != (n_layers, hidden_size):
        raise ValueError(
            f"sample {sample.sample_id!r}: hidden_states shape {tuple(hidden.shape)}, "
            f"expected [T, {n_layers}, {hidden_size}]"
        )
    num_tokens = hidden.shape[0]
    if num_tokens < 1 or tokens.shape != (num_tokens,) or mask.shape != (num_tokens,):
        raise ValueError(
            f"sample {sample.sample_id!r}: token_ids {tuple(tokens.shape)} and loss_mask "
            f"{tuple(mask.shape)} must both be [{num_tokens}] with T >= 1"
        )
    if mask.dtype not in (torch.uint8, torch.bool) or bool((mask.to(torch.uint8) > 1).any()):
        raise ValueError(f"sample {sample.sample_id!r}: loss_mask must be 0/1 uint8 or bool")
    token_name = token_dtype_name(tokens.dtype)
    if fp8.is_fp8(dtype):
        # Quantised here, where the shard is written: vLLM gives bf16/fp32 states.
        values, scales = fp8.quantise(hidden, dtype)
        hidden_tensors = [
            ("hidden_scales", fp8.SCALE_DTYPE[1], list(scales.shape), _raw(scales)),
            ("hidden_states", fp8.FP8_FORMATS[dtype].code, list(hidden.shape), _raw(values)),
        ]
    else:
        torch_dtype, code = HIDDEN_DTYPES[dtype]
        # Casting to the recipe's stored dtype is the point of `extraction.dtype` (vLLM may run in fp32).
        hidden_tensors = [("hidden_states", code, list(hidden.shape), _raw(hidden.to(torch_dtype)))]
    return [
        ("token_ids", TOKEN_DTYPES[token_name][1], [num_tokens], _raw(tokens)),
        *hidden_tensors,
        ("loss_mask", MASK_DTYPE[1], [num_tokens], _raw(mask.to(torch.uint8))),
    ]


def write_shard_stream(
    f: IO[bytes],
    samples: Sequence[tuple[int, Sample]],
    *,
    dtype: str,
    n_layers: int,
    hidden_size: int,
    metadata: Mapping[str, str],
) -> WrittenShard:
    """Write ``(index_in_shard, sample)`` pairs as one safetensors shard to ``f``, hashing on the way.

    Tensor names carry the sample's index in its shard (``3.hidden_states``), which is also
    its ``index_in_shard`` in the manifest; indices of failed samples are simply absent.
    """
    if dtype not in stored_dtypes():
        raise ValueError(f"dtype must be one of {sorted(stored_dtypes())}, got {dtype!r}")
    prepared = [(i, _prepare(s, dtype, n_layers, hidden_size)) for i, s in samples]
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    rel_spans: list[dict[str, TensorSpan]] = []
    paddings: list[int] = []
    pos = 0
    for i, tensors in prepared:
        spans = {}
        for suffix, code, shape, data in tensors:
            header[f"{i}.{suffix}"] = {
                "dtype": code,
                "shape": shape,
                "data_offsets": [pos, pos + data.nbytes],
            }
            spans[suffix] = TensorSpan(pos, data.nbytes)
            pos += data.nbytes
        pad = -pos % _ALIGN
        if pad:
            header[f"{i}.padding"] = {"dtype": "U8", "shape": [pad], "data_offsets": [pos, pos + pad]}
            pos += pad
        rel_spans.append(spans)
        paddings.append(pad)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-(8 + len(header_bytes)) % _ALIGN)
    data_start = 8 + len(header_bytes)

    shard_hash = hashlib.sha256()

    def put(chunk: bytes | memoryview) -> None:
        shard_hash.update(chunk)
        f.write(chunk)

    put(struct.pack("<Q", len(header_bytes)))
    put(header_bytes)
    sample_hashes = []
    for (_, tensors), pad in zip(prepared, paddings, strict=True):
        sample_hash = hashlib.sha256()  # over the sample's contiguous range, padding excluded
        for _, _, _, data in tensors:
            sample_hash.update(data)
            put(data)
        put(bytes(pad))
        sample_hashes.append(sample_hash.hexdigest())
    spans = tuple(
        SampleSpans(
            *(
                TensorSpan(data_start + s[name].offset, s[name].length)
                for name in ("token_ids", "hidden_states", "loss_mask")
            )
        )
        for s in rel_spans
    )
    return WrittenShard(data_start + pos, shard_hash.hexdigest(), spans, tuple(sample_hashes))


def read_header(head: bytes) -> tuple[dict, int]:
    """Parse a shard's header from its first bytes; returns (header, data start offset).

    ``head`` must hold at least the 8-byte length and the header; more is ignored.
    """
    if len(head) < 8:
        raise ValueError("not a safetensors shard: shorter than 8 bytes")
    (length,) = struct.unpack("<Q", head[:8])
    if len(head) < 8 + length:
        raise ValueError(f"truncated safetensors header: need {8 + length} bytes, have {len(head)}")
    header = json.loads(head[8 : 8 + length])
    if header.get("__metadata__", {}).get("format") != FORMAT:
        raise ValueError("not a draftflow shard (header metadata has no matching `format`)")
    return header, 8 + length


def data_end(header: Mapping) -> int:
    """Size of the data section the header describes (the object's size minus the header)."""
    return max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)


def tensor_from(
    buf: bytearray | memoryview, offset: int, length: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """A tensor viewing ``buf[offset:offset+length]`` (no copy; ``buf`` must be writable)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(buf, dtype=dtype, count=length // itemsize, offset=offset).view(*shape)


def sample_from(
    buf: bytearray | memoryview,
    base: int,
    sample_id: str,
    spans: SampleSpans,
    *,
    dtype: str,
    token_dtype: str,
    n_layers: int,
    hidden_size: int,
    decode_dtype: torch.dtype = fp8.DECODE_DTYPE,
) -> Sample:
    """Rebuild a sample from a buffer holding its bytes; ``base`` = shard offset of ``buf[0]``.

    Plain dtypes view ``buf`` without a copy; FP8 hidden states are decoded to ``decode_dtype``
    (default fp32, exact) in one vectorised multiply.
    """
    num_tokens = spans.loss_mask.length
    if fp8.is_fp8(dtype):
        fmt = fp8.require_float8(dtype)
        scales = spans.hidden_scales(num_tokens, n_layers)
        hidden = fp8.dequantise(
            tensor_from(
                buf,
                spans.hidden_states.offset - base,
                spans.hidden_states.length,
                fmt.torch_dtype,
                [num_tokens, n_layers, hidden_size],
            ),
            tensor_from(buf, scales.offset - base, scales.length, fp8.SCALE_DTYPE[0], [num_tokens, n_layers]),
            decode_dtype,
        )
    else:
        hidden = tensor_from(
            buf,
            spans.hidden_states.offset - base,
            spans.hidden_states.length,
            HIDDEN_DTYPES[dtype][0],
            [num_tokens, n_layers, hidden_size],
        )
    return Sample(
        sample_id=sample_id,
        token_ids=tensor_from(
            buf,
            spans.token_ids.offset - base,
            spans.token_ids.length,
            TOKEN_DTYPES[token_dtype][0],
            [num_tokens],
        ),
        hidden_states=hidden,
        loss_mask=tensor_from(
            buf, spans.loss_mask.offset - base, spans.loss_mask.length, torch.uint8, [num_tokens]
        ),
    )
