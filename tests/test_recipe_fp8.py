"""Recipes asking for FP8 hidden states: accepted values, fingerprint, and a torch without float8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftflow.plan import Plan
from draftflow.recipe import RecipeError, fingerprint, load_recipe, validate
from draftflow.store.fp8 import server_dtype

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "smollm2-135m-dflash-cpu.yaml"


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
def test_fp8_dtypes_validate_and_get_their_own_data_folder(dtype):
    bf16 = validate(str(DEMO), ["extraction.dtype=bfloat16"])
    fp8 = validate(str(DEMO), [f"extraction.dtype={dtype}"])
    assert fp8.recipe.extraction.dtype == dtype
    assert fingerprint(fp8.recipe, fp8.layer_ids) != fingerprint(bf16.recipe, bf16.layer_ids)
    assert Plan.load(str(DEMO), [f"extraction.dtype={dtype}"]).data.root != Plan.load(str(DEMO)).data.root
    assert server_dtype(dtype) == "bfloat16"  # vLLM computes in bf16; the shard writer quantises


@pytest.mark.parametrize("bad", ["float8", "fp8_e4m3", "float8_e4m3fn", "e4m3"])
def test_misspelt_fp8_dtype_names_the_field_and_the_choices(bad):
    with pytest.raises(RecipeError) as err:
        load_recipe(DEMO, [f"extraction.dtype={bad}"])
    message = str(err.value)
    assert "\n" not in message and "extraction.dtype" in message and "'float8_e4m3'" in message, message


@pytest.mark.parametrize(
    "dtype, attribute", [("float8_e4m3", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2")]
)
def test_fp8_with_a_torch_lacking_float8_fails_at_validation_in_one_line(monkeypatch, dtype, attribute):
    """No torch build without float8 dtypes can be installed here, so one is simulated by removing
    the dtype from the installed torch for this test; the real capability check then runs."""
    monkeypatch.delattr(torch, attribute)
    with pytest.raises(RecipeError) as err:
        load_recipe(DEMO, [f"extraction.dtype={dtype}"])
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"{DEMO}: extraction.dtype: {dtype} needs float8 support in torch"), message
    assert f"has no torch.{attribute}" in message, message
    assert load_recipe(DEMO, ["extraction.dtype=bfloat16"]).extraction.dtype == "bfloat16"  # no float8 needed


def test_fp8_with_a_torch_that_casts_float8_wrongly_fails_at_validation(monkeypatch):
    """Simulated as above: the float8 dtype is replaced by one that cannot hold 448 exactly."""
    monkeypatch.setattr(torch, "float8_e4m3fn", torch.int8)
    with pytest.raises(RecipeError, match="extraction.dtype: float8_e4m3 needs float8 support"):
        load_recipe(DEMO, ["extraction.dtype=float8_e4m3"])
