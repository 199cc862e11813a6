"""The shard format: bit-exact roundtrips on every backend, safetensors compatibility, alignment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import safetensors
import store_synthetic as syn
import torch

from draftflow.store import iter_shard, load_sample, read_manifest, write_shard
from draftflow.store.shard import HIDDEN_DTYPES, TOKEN_DTYPES, read_header

STORE_PACKAGE = Path(__file__).resolve().parents[2] / "draftflow" / "store"


@pytest.mark.parametrize("dtype", list(HIDDEN_DTYPES))
def test_roundtrip_is_bit_identical(store, dtype):
    token_dtypes = [torch.int64, torch.int32]
    # Odd token counts and an odd hidden size put tensors at every alignment the format allows.
    samples = [
        syn.sample(
            f"{dtype}-{i}",
            num_tokens=[1, 7, 33, 2][i],
            dtype=dtype,
            token_dtype=token_dtypes[i % 2],
            hidden_size=13,
        )
        for i in range(4)
    ]
    info = syn.info(dtype, hidden_size=13)
    write_shard(store, "000000", samples, info)
    manifest = read_manifest(store)
    assert manifest["sample_id"].to_pylist() == [s.sample_id for s in samples]
    assert set(manifest["dtype"].to_pylist()) == {dtype}

    for verify in ("shard", "sample", "none"):
        for want in samples:
            syn.assert_same(load_sample(store, manifest, want.sample_id, verify=verify), want)
        got = list(iter_shard(store, manifest, "000000", verify=verify))
        assert len(got) == len(samples)
        for g, want in zip(got, samples, strict=True):
            syn.assert_same(g, want)


def test_shard_is_plain_safetensors_with_aligned_tensors(local_store):
    samples = [
        syn.sample(f"a{i}", num_tokens=5 + i, token_dtype=torch.int32 if i % 2 else torch.int64)
        for i in range(3)
    ]
    committed = write_shard(local_store, "000000", samples, syn.info())
    with safetensors.safe_open(committed.shard_url, "pt") as f:
        meta = f.metadata()
        for i, want in enumerate(samples):
            syn.assert_same(
                type(want)(
                    want.sample_id,
                    f.get_tensor(f"{i}.hidden_states"),
                    f.get_tensor(f"{i}.token_ids"),
                    f.get_tensor(f"{i}.loss_mask"),
                ),
                want,
            )
    assert meta["format"] == "draftflow-shard" and meta["shard_id"] == "000000"
    assert meta["writer"] == committed.writer

    raw = Path(committed.shard_url).read_bytes()
    header, data_start = read_header(raw)
    assert data_start % 8 == 0
    itemsize = {
        code: torch.empty((), dtype=t).element_size()
        for t, code in (*HIDDEN_DTYPES.values(), *TOKEN_DTYPES.values())
    }
    for name, entry in header.items():
        if name != "__metadata__":
            assert (data_start + entry["data_offsets"][0]) % itemsize.get(entry["dtype"], 1) == 0, name


def test_bad_samples_are_rejected_before_anything_is_written(local_store):
    good = syn.sample("ok")
    wrong_layers = syn.sample("bad", n_layers=2)
    with pytest.raises(ValueError, match="hidden_states shape"):
        write_shard(local_store, "000000", [good, wrong_layers], syn.info())
    float_tokens = type(good)("f", good.hidden_states, good.token_ids.float(), good.loss_mask)
    with pytest.raises(ValueError, match="int32 or int64"):
        write_shard(local_store, "000000", [float_tokens], syn.info())
    with pytest.raises(ValueError, match="duplicate"):
        write_shard(local_store, "000000", [good, good], syn.info())
    assert len(read_manifest(local_store)) == 0


def test_hidden_states_are_cast_to_the_recipe_dtype(local_store):
    fp32 = syn.sample("x", dtype="float32")
    write_shard(local_store, "000000", [fp32], syn.info("bfloat16"))
    got = load_sample(local_store, read_manifest(local_store), "x")
    assert got.hidden_states.dtype == torch.bfloat16
    assert torch.equal(
        got.hidden_states.view(torch.int16), fp32.hidden_states.to(torch.bfloat16).view(torch.int16)
    )


def test_store_package_never_unpickles():
    for path in STORE_PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert not names & {"pickle", "dill", "cloudpickle", "joblib"}, path
        assert not {
            c
            for c in calls
            if c.endswith(("torch.load", "pickle.loads", "pickle.load", "numpy.load", "np.load"))
        }, path
