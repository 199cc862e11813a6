"""The checkpoint contract: each silent export mistake is caught, with a message saying what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from known_drafters import dflash_checkpoint, eagle3_checkpoint
from safetensors.torch import load_file, save_file

from draftflow.evaluation.contract import ContractError, assert_contract, check_contract
from draftflow.models.provenance import d2t_digest, read_provenance, write_provenance
from draftflow.paths import EXPORT_CONFIG, EXPORT_WEIGHTS, PROVENANCE
from draftflow.target import read_target_info


@pytest.fixture(scope="module")
def sound(tiny_llama_dir, tmp_path_factory):
    """A DFlash (reduced vocab, mask token 7) and an Eagle3 (full vocab) for the 4-layer tiny Llama."""
    root = tmp_path_factory.mktemp("contract")
    return {
        "dflash": dflash_checkpoint(tiny_llama_dir, root / "dflash", mask_token_id=7, draft_vocab_size=256),
        "eagle3": eagle3_checkpoint(tiny_llama_dir, root / "eagle3"),
    }


@pytest.fixture
def copy(sound, tmp_path):
    def make(kind: str):
        return shutil.copytree(sound[kind], tmp_path / kind)

    return make


def edit_config(folder, change) -> None:
    config = json.loads((folder / EXPORT_CONFIG).read_text())
    change(config)
    (folder / EXPORT_CONFIG).write_text(json.dumps(config))


def edit_weights(folder, change) -> None:
    tensors = load_file(str(folder / EXPORT_WEIGHTS))
    change(tensors)
    save_file(tensors, str(folder / EXPORT_WEIGHTS))


def one(problems: list[str]) -> str:
    assert len(problems) == 1, problems
    return problems[0]


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_sound_checkpoint_has_no_problems(sound, tiny_llama_dir, kind):
    info = read_target_info(str(tiny_llama_dir))
    assert check_contract(sound[kind], info, verifier=str(tiny_llama_dir), fingerprint="test-fp") == []
    assert_contract(sound[kind], info)
    prov = read_provenance(sound[kind])
    assert prov["aux_layer_ids"] == [1, 2] and prov["extracted_layer_ids"] == [1, 2, 4]


def test_layer_ids_shifted_by_one(copy):
    folder = copy("dflash")
    edit_config(folder, lambda c: c.update(aux_hidden_state_layer_ids=[2, 3]))
    assert (
        one(check_contract(folder))
        == "config.json aux_hidden_state_layer_ids [2, 3] != trained [1, 2] (shifted by one?)"
    )
    folder = copy("eagle3")
    edit_config(folder, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1]))
    assert (
        one(check_contract(folder))
        == "config.json eagle_aux_hidden_state_layer_ids [0, 1] != trained [1, 2] (shifted by one?)"
    )


def test_wrong_d2t(copy):
    folder = copy("dflash")
    trained = read_provenance(folder)["d2t_sha256"]
    # another vocabulary of the same size: shapes and dtypes are all still right
    edit_weights(folder, lambda t: t.update(d2t=torch.arange(256) * 3 + 1 - torch.arange(256)))
    message = one(check_contract(folder))
    assert message.startswith("model.safetensors d2t (sha256 ")
    assert (
        f"!= the draft vocabulary used in training (sha256 {trained[:12]}…): a stale or foreign d2t mapping"
    ) in message


def test_wrong_mask_token(copy):
    folder = copy("dflash")
    edit_config(folder, lambda c: c.update(mask_token_id=0))
    assert one(check_contract(folder)).startswith("config.json mask_token_id 0 != trained 7")


def test_verifier_and_draft_length_mismatches(copy, tiny_llama_dir):
    folder = copy("eagle3")

    def change(c):
        c["speculators_config"]["verifier"]["name_or_path"] = "someone/other-model"
        c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 5

    edit_config(folder, change)
    problems = check_contract(folder, verifier=str(tiny_llama_dir))
    assert (
        f"config.json verifier 'someone/other-model' != the target trained against '{tiny_llama_dir}'"
        in problems
    )
    assert "config.json speculative_tokens 5 != trained 3" in problems
    assert (
        f"config.json verifier 'someone/other-model' != the target evaluated here '{tiny_llama_dir}'"
        in problems
    )
    folder = copy("dflash")
    edit_config(folder, lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=7))
    assert "config.json block_size 4 drafts 1 to 3 tokens but speculative_tokens is 7" in check_contract(
        folder
    )


def test_fc_shape_against_number_of_aux_layers(copy):
    folder = copy("dflash")
    edit_config(folder, lambda c: c.update(aux_hidden_state_layer_ids=[1, 2, 3]))
    problems = check_contract(folder)
    assert (
        "fc.weight shape [64, 128] does not read the 3 aux layers [1, 2, 3] of hidden size 64 "
        "(expected [64, 192])" in problems
    )
    assert "config.json aux_hidden_state_layer_ids [1, 2, 3] != trained [1, 2]" in problems


def test_lm_head_rows_against_draft_vocab_size(copy):
    folder = copy("dflash")
    prov = read_provenance(folder)
    write_provenance(folder, **{**prov, "draft_vocab_size": 512})
    assert (
        one(check_contract(folder))
        == "lm_head.weight has 256 rows but the drafter was trained with draft_vocab_size 512"
    )
    edit_config(folder, lambda c: c.update(draft_vocab_size=300))
    assert "lm_head.weight has 256 rows but config.json draft_vocab_size is 300" in check_contract(folder)


def test_reduced_vocabulary_in_file_but_full_vocabulary_in_training(copy):
    folder = copy("dflash")
    prov = read_provenance(folder)
    write_provenance(folder, **{**prov, "draft_vocab_size": None, "d2t_sha256": None})
    assert (
        one(check_contract(folder))
        == "model.safetensors ships a d2t mapping but the drafter was trained on the full vocabulary"
    )


def test_identity_vocabulary_digest_matches_training_record(copy):
    """The trainer may hash an all-zero d2t for a full vocabulary; no d2t in the file is the same."""
    folder = copy("eagle3")
    prov = read_provenance(folder)
    write_provenance(folder, **{**prov, "d2t_sha256": d2t_digest(torch.zeros(49152, dtype=torch.long))})
    assert check_contract(folder) == []


def test_missing_provenance_fingerprint_and_target_mismatch(copy, tiny_llama_dir, smollm2_dir):
    folder = copy("eagle3")
    assert check_contract(folder, fingerprint="another-fp") == [
        "checkpoint trained on data 'test-fp' but evaluated with recipe data 'another-fp': its eval split is not "
        "known to be held out for this checkpoint"
    ]
    problems = check_contract(folder, read_target_info(str(smollm2_dir)))
    assert "drafter hidden size 64 != the target's 576" in problems
    (folder / PROVENANCE).unlink()
    assert one(check_contract(folder)).startswith(
        f"no {PROVENANCE} in {folder}: the trainer's record is missing"
    )


def test_assert_contract_lists_every_problem(copy):
    folder = copy("dflash")
    edit_config(folder, lambda c: c.update(aux_hidden_state_layer_ids=[2, 3], mask_token_id=0))
    with pytest.raises(ContractError) as err:
        assert_contract(folder)
    assert "(shifted by one?)" in str(err.value) and "mask_token_id 0 != trained 7" in str(err.value)


def test_write_provenance_requires_every_field(tmp_path):
    with pytest.raises(ValueError, match="missing fields .*'fingerprint'.*unknown fields \\['color'\\]"):
        write_provenance(tmp_path, recipe_name="r", drafter="dflash", color="red")
