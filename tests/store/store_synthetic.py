"""Synthetic samples for the store tests and for the writer subprocess of the crash test.

Deterministic from the sample id, so a rerun after a crash writes the same tensors, and
built from random *bit patterns* so every float class (NaN payloads, ±inf, -0.0, subnormals)
is exercised by the bit-exact roundtrip checks.
"""

from __future__ import annotations

import zlib

import torch

from draftflow.store import ExpectedSample, ExtractionInfo, Sample

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def info(
    dtype: str = "bfloat16", n_layers: int = 3, hidden_size: int = 16, mode: str = "offline"
) -> ExtractionInfo:
    return ExtractionInfo(
        dtype=dtype,
        layer_ids=tuple(range(2, 2 + n_layers)),
        hidden_size=hidden_size,
        target="test/tiny-target",
        target_revision="abc123",
        mode=mode,
        vllm_version="0.32.0",
    )


def num_tokens_for(sample_id: str, low: int = 3, high: int = 40) -> int:
    return low + zlib.crc32(sample_id.encode()) % (high - low)


def sample(
    sample_id: str,
    num_tokens: int | None = None,
    *,
    dtype: str = "bfloat16",
    token_dtype: torch.dtype = torch.int64,
    n_layers: int = 3,
    hidden_size: int = 16,
) -> Sample:
    num_tokens = num_tokens_for(sample_id) if num_tokens is None else num_tokens
    gen = torch.Generator().manual_seed(zlib.crc32(sample_id.encode()))
    torch_dtype = DTYPES[dtype]
    bits_dtype = BITS[torch_dtype]
    info_ = torch.iinfo(bits_dtype)
    bits = torch.randint(
        info_.min, info_.max, (num_tokens, n_layers, hidden_size), generator=gen, dtype=torch.int64
    )
    return Sample(
        sample_id=sample_id,
        hidden_states=bits.to(bits_dtype).view(torch_dtype),
        token_ids=torch.randint(0, 49152, (num_tokens,), generator=gen, dtype=torch.int64).to(token_dtype),
        loss_mask=torch.randint(0, 2, (num_tokens,), generator=gen, dtype=torch.uint8),
    )


def expected(n: int, prefix: str = "s") -> list[ExpectedSample]:
    ids = [f"{prefix}{i:05d}" for i in range(n)]
    return [ExpectedSample(i, num_tokens_for(i)) for i in ids]


def assert_same(got: Sample, want: Sample) -> None:
    """Bit-for-bit equality (NaN payloads included), dtype and shape."""
    assert got.sample_id == want.sample_id
    assert got.hidden_states.dtype == want.hidden_states.dtype
    assert got.hidden_states.shape == want.hidden_states.shape
    bits = BITS[want.hidden_states.dtype]
    assert torch.equal(got.hidden_states.view(bits), want.hidden_states.view(bits))
    assert got.token_ids.dtype == want.token_ids.dtype
    assert torch.equal(got.token_ids, want.token_ids)
    assert got.loss_mask.dtype == torch.uint8
    assert torch.equal(got.loss_mask, want.loss_mask)


def fp8_sample(
    sample_id: str, num_tokens: int | None = None, *, n_layers: int = 3, hidden_size: int = 16
) -> Sample:
    """Finite fp32 states for FP8 shards (which refuse inf/NaN): rows of very different
    magnitudes (1e-3 .. 1e4), an outlier column like SmolLM2's, and an all-zero row."""
    num_tokens = num_tokens_for(sample_id) if num_tokens is None else num_tokens
    gen = torch.Generator().manual_seed(zlib.crc32(sample_id.encode()))
    row_scale = 10.0 ** (torch.rand((num_tokens, n_layers, 1), generator=gen) * 7 - 3)
    hidden = torch.randn((num_tokens, n_layers, hidden_size), generator=gen) * row_scale
    hidden[:, :, 0] *= 50.0
    hidden[0, 0] = 0.0
    return Sample(
        sample_id=sample_id,
        hidden_states=hidden,
        token_ids=torch.randint(0, 49152, (num_tokens,), generator=gen, dtype=torch.int32),
        loss_mask=torch.randint(0, 2, (num_tokens,), generator=gen, dtype=torch.uint8),
    )


def as_read_back(sample: Sample, dtype: str) -> Sample:
    """What a store of ``dtype`` returns for ``sample`` (FP8: quantised, then decoded in fp32)."""
    from draftflow.store.shard import as_stored

    hidden = as_stored(sample.hidden_states, dtype)
    return Sample(sample.sample_id, hidden, sample.token_ids, sample.loss_mask)
