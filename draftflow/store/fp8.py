"""FP8 hidden states: per-token scaled float8 values, about half the bytes of bf16.

Each row of a sample's hidden states (one token, one layer: ``H`` values) is stored as

* ``scale = amax(|row|) / FP8_MAX`` (448 for e4m3, 57344 for e5m2), rounded to bfloat16;
* ``values = row / scale`` cast to float8 (clamped to ±FP8_MAX first).

Decoding is one broadcast multiply over the whole sample (``values.float() * scale``), no
loop per token. Why the scale is bfloat16 and the decode fp32: an fp8 value has 4 significant
bits and a bf16 scale 8, so ``value * scale`` is exact in fp32 and quantising the decoded
tensor again gives back the very same values and scales. So a sample trained on straight
from vLLM (online / hybrid mode, :func:`fake_quantise`) is bit-identical to the same sample
read back from the store, and re-writing a decoded sample never drifts. A bf16 scale also
costs 2 bytes per row instead of 4 (SmolLM2, 4 layers x 576: 2,312 bytes per token, 0.502x bf16).

Torch builds without float8 dtypes cannot read or write these shards; recipe validation asks
:func:`float8_unavailable` so that such a machine fails at once, naming ``extraction.dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Float8Format:
    """One recipe FP8 dtype: its torch attribute name, safetensors code and largest finite value."""

    torch_name: str
    code: str
    max_value: float

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_name)


FP8_FORMATS: dict[str, Float8Format] = {
    "float8_e4m3": Float8Format("float8_e4m3fn", "F8_E4M3", 448.0),
    "float8_e5m2": Float8Format("float8_e5m2", "F8_E5M2", 57344.0),
}
SCALE_DTYPE = (torch.bfloat16, "BF16")  # one scale per (token, layer) row
DECODE_DTYPE = torch.float32  # exact for value * scale (see the module docstring)


def is_fp8(dtype: str) -> bool:
    return dtype in FP8_FORMATS


def float8_unavailable(dtype: str) -> str | None:
    """Why this torch cannot store ``dtype`` as FP8 (one line), or None when it can."""
    fmt = FP8_FORMATS[dtype]
    torch_dtype = getattr(torch, fmt.torch_name, None)
    if torch_dtype is None:
        return f"this torch ({torch.__version__}) has no torch.{fmt.torch_name}"
    try:
        probe = torch.tensor([1.5, -fmt.max_value]).to(torch_dtype).to(torch.float32)
    except (RuntimeError, TypeError) as err:
        return f"this torch ({torch.__version__}) cannot cast to torch.{fmt.torch_name}: {err}"
    if probe.tolist() != [1.5, -fmt.max_value]:
        return f"this torch ({torch.__version__}) casts to torch.{fmt.torch_name} wrongly"
    return None


def require_float8(dtype: str) -> Float8Format:
    """The format of ``dtype``; a one-line error when this torch lacks it."""
    reason = float8_unavailable(dtype)
    if reason:
        raise RuntimeError(f"hidden states stored as {dtype}, but {reason}; use a torch with float8 dtypes")
    return FP8_FORMATS[dtype]


def quantise(hidden: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` [..., H] (any float dtype) -> (fp8 values [..., H], bf16 scales [...])."""
    fmt = require_float8(dtype)
    rows = hidden.detach().to(torch.float32)
    amax = rows.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"hidden states with inf or NaN cannot be stored as {dtype}")
    scales = (amax / fmt.max_value).to(SCALE_DTYPE[0])
    # A zero row (or one so small that its scale underflows) gets scale 1: its values become 0.
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = (rows / scales.to(torch.float32).unsqueeze(-1)).clamp_(-fmt.max_value, fmt.max_value)
    return values.to(fmt.torch_dtype), scales


def dequantise(
    values: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = DECODE_DTYPE
) -> torch.Tensor:
    """fp8 ``values`` [..., H] times ``scales`` [...], one vectorised multiply, as ``out_dtype``."""
    decoded = values.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
    return decoded if out_dtype == torch.float32 else decoded.to(out_dtype)


def fake_quantise(hidden: torch.Tensor, dtype: str) -> torch.Tensor:
    """What the store will give back for ``hidden`` stored as ``dtype`` (decoded in fp32)."""
    return dequantise(*quantise(hidden, dtype))


def server_dtype(dtype: str) -> str:
    """The dtype vLLM computes in for a stored dtype: bf16 for FP8 stores (quantised on write)."""
    return "bfloat16" if is_fp8(dtype) else dtype
