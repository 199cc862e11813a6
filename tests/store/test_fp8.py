"""FP8 shards: per-row scales beside the values, exact vectorised decode, checksums, bytes."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest
import safetensors
import store_synthetic as syn
import torch

from draftflow.store import (
    CorruptShardError,
    fp8,
    iter_shard,
    load_sample,
    read_manifest,
    verify,
    write_shard,
)
from draftflow.store.shard import FORMAT_VERSION, read_header

FP8 = list(fp8.FP8_FORMATS)
# Largest decode error relative to the row's amax: half the fp8 spacing just below the maximum
# (e4m3: 16/448, e5m2: 4096/57344), plus the bf16 rounding of the scale (2^-9).
MAX_ERR_OF_AMAX = {"float8_e4m3": 16 / 448 + 2**-9, "float8_e5m2": 4096 / 57344 + 2**-9}


def _row(manifest, sample_id: str) -> dict:
    return manifest.filter(pc.equal(manifest["sample_id"], sample_id)).to_pylist()[0]


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_roundtrip_decodes_what_was_quantised(store, dtype):
    # Odd token counts and an odd hidden size: scales and values at every alignment the format allows.
    samples = [syn.fp8_sample(f"{dtype}-{i}", num_tokens=[1, 7, 33, 2][i], hidden_size=13) for i in range(4)]
    write_shard(store, "000000", samples, syn.info(dtype, hidden_size=13))
    manifest = read_manifest(store)
    assert set(manifest["dtype"].to_pylist()) == {dtype}
    assert set(manifest["shard_format"].to_pylist()) == {FORMAT_VERSION} == {2}

    for verify_mode in ("shard", "sample", "none"):
        loaded = [load_sample(store, manifest, s.sample_id, verify=verify_mode) for s in samples]
        iterated = list(iter_shard(store, manifest, "000000", verify=verify_mode))
        for got, want in zip([*loaded, *iterated], samples * 2, strict=True):
            assert got.hidden_states.dtype == torch.float32
            syn.assert_same(got, syn.as_read_back(want, dtype))  # bit-exact: decode is exact in fp32
            err = (got.hidden_states - want.hidden_states).abs().amax(-1)
            amax = want.hidden_states.abs().amax(-1)
            assert bool((err <= MAX_ERR_OF_AMAX[dtype] * amax).all())
    zero_row = load_sample(store, manifest, samples[2].sample_id).hidden_states[0, 0]
    assert torch.equal(zero_row, torch.zeros(13))

    as_bf16 = load_sample(store, manifest, samples[2].sample_id, decode_dtype=torch.bfloat16)
    assert as_bf16.hidden_states.dtype == torch.bfloat16
    assert torch.equal(as_bf16.hidden_states, syn.as_read_back(samples[2], dtype).hidden_states.bfloat16())


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_shard_is_safetensors_with_scales_between_token_ids_and_values(local_store, dtype):
    samples = [syn.fp8_sample(f"a{i}", num_tokens=5 + i, hidden_size=576, n_layers=4) for i in range(3)]
    committed = write_shard(local_store, "000000", samples, syn.info(dtype, n_layers=4, hidden_size=576))
    with safetensors.safe_open(committed.shard_url, "pt") as f:
        assert f.metadata()["format_version"] == "2"
        for i, want in enumerate(samples):
            values, scales = fp8.quantise(want.hidden_states, dtype)
            got_values = f.get_tensor(f"{i}.hidden_states")
            assert got_values.dtype == fp8.FP8_FORMATS[dtype].torch_dtype
            assert torch.equal(got_values.view(torch.uint8), values.view(torch.uint8))
            assert torch.equal(f.get_tensor(f"{i}.hidden_scales"), scales)

    header, data_start = read_header(Path(committed.shard_url).read_bytes())
    itemsize = {"BF16": 2, "I32": 4, "I64": 8}
    for name, entry in header.items():
        if name != "__metadata__":
            assert (data_start + entry["data_offsets"][0]) % itemsize.get(entry["dtype"], 1) == 0, name
    manifest = read_manifest(local_store)
    for i, want in enumerate(samples):
        row = _row(manifest, want.sample_id)
        tokens = want.num_tokens
        assert row["hidden_states_length"] == tokens * 4 * 576  # one byte per value
        scales = header[f"{i}.hidden_scales"]["data_offsets"]
        assert data_start + scales[0] == row["token_ids_offset"] + row["token_ids_length"]
        assert data_start + scales[1] == row["hidden_states_offset"]
        assert scales[1] - scales[0] == tokens * 4 * 2  # one bf16 scale per token and layer
        # Bytes per token against bf16 (token id + mask included): the target is <= 0.55x.
        fp8_bytes = row["loss_mask_offset"] + row["loss_mask_length"] - row["token_ids_offset"]
        assert fp8_bytes / (tokens * (4 + 4 * 576 * 2 + 1)) <= 0.505


def test_flipped_scale_byte_fails_the_checksums(local_store):
    samples = [syn.fp8_sample(f"c{i}", num_tokens=9) for i in range(3)]
    committed = write_shard(local_store, "000000", samples, syn.info("float8_e4m3"))
    manifest = read_manifest(local_store)
    row = _row(manifest, "c1")
    raw = bytearray(Path(committed.shard_url).read_bytes())
    raw[row["token_ids_offset"] + row["token_ids_length"] + 1] ^= 0x40  # inside c1's scales
    Path(committed.shard_url).write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match="c1"):
        load_sample(local_store, manifest, "c1", verify="sample")
    intact = load_sample(local_store, manifest, "c0", verify="sample")
    syn.assert_same(intact, syn.as_read_back(samples[0], "float8_e4m3"))
    with pytest.raises(CorruptShardError, match="sha256"):
        load_sample(local_store, manifest, "c0", verify="shard")
    assert [b.shard_id for b in verify(local_store).bad] == ["000000"]


@pytest.mark.parametrize("dtype", FP8)
def test_vectorised_decode_equals_a_per_row_reference(dtype):
    hidden = syn.fp8_sample("rows", num_tokens=37, n_layers=4, hidden_size=64).hidden_states
    values, scales = fp8.quantise(hidden, dtype)
    assert values.shape == hidden.shape and scales.shape == hidden.shape[:2]
    assert scales.dtype == torch.bfloat16
    fmt = fp8.FP8_FORMATS[dtype]
    reference = torch.empty_like(hidden)
    for t in range(hidden.shape[0]):
        for layer in range(hidden.shape[1]):
            row = hidden[t, layer]
            scale = torch.tensor(row.abs().max().item() / fmt.max_value).bfloat16().float()
            scale = scale if scale > 0 else torch.tensor(1.0)
            assert scales[t, layer].float() == scale
            q = (row / scale).clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype)
            reference[t, layer] = torch.tensor([float(v) * float(scale) for v in q.float()])
    assert torch.equal(fp8.dequantise(values, scales), reference)
    # Quantising the decoded states again changes nothing: online and stored samples agree exactly.
    again = fp8.quantise(reference, dtype)
    assert torch.equal(again[0].view(torch.uint8), values.view(torch.uint8)) and torch.equal(again[1], scales)


def test_non_finite_states_are_refused_before_anything_is_written(local_store):
    bad = syn.fp8_sample("inf", num_tokens=4)
    bad.hidden_states[2, 1, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN cannot be stored as float8_e4m3"):
        write_shard(local_store, "000000", [syn.fp8_sample("ok", num_tokens=4), bad], syn.info("float8_e4m3"))
    assert len(read_manifest(local_store)) == 0


def test_reading_fp8_without_float8_in_torch_is_one_clear_line(local_store, monkeypatch):
    """No torch without float8 dtypes is installable here, so its absence is simulated by removing
    the dtype attribute from the installed torch for the duration of the test."""
    write_shard(local_store, "000000", [syn.fp8_sample("x", num_tokens=3)], syn.info("float8_e4m3"))
    manifest = read_manifest(local_store)
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(RuntimeError) as err:
        load_sample(local_store, manifest, "x")
    message = str(err.value)
    assert "\n" not in message and "float8_e4m3" in message and "no torch.float8_e4m3fn" in message
