"""`draftflow evaluate` / evaluate_checkpoint on a real prepared recipe (offline; vLLM is covered by
test_known_behaviour_vllm.py through the same evaluate_prompts)."""

from __future__ import annotations

import json

import pytest
import yaml
from known_drafters import dflash_checkpoint

from draftflow.cli import main
from draftflow.data.chat import load_chat_encoder
from draftflow.data.dataset import EVAL, TRAIN, load_prepared
from draftflow.data.prepare import prepare
from draftflow.evaluation.contract import ContractError
from draftflow.evaluation.report import Evaluation
from draftflow.evaluation.run import AgreementError, default_eval_dir, evaluate_checkpoint, evaluate_prompts
from draftflow.plan import Plan

pytestmark = pytest.mark.slow

HA = 421
QUESTIONS = [
    "Laugh: say ha ha ha ha ha ha ha ha ha ha ha ha ha.",
    "Laugh out loud: ha ha ha ha ha ha ha ha ha!",
    "Say: ha ha, ha ha ha, ha, ha ha ha ha",
    "Laugh twice: ha ha. Then laugh three times: ha ha ha.",
    "What is the capital of France?",
    "Name a color.",
]


@pytest.fixture(scope="module")
def recipe(smollm2_dir, tmp_path_factory):
    """A recipe over six conversations (two held out), prepared with the real prepare stage."""
    root = tmp_path_factory.mktemp("recipe")
    records = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ha ha"}]}
        for q in QUESTIONS
    ]
    (root / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    path = root / "recipe.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "eval-test",
                "target": {"model": str(smollm2_dir)},
                "data": {
                    "sources": [{"kind": "messages", "path": str(root / "chats.jsonl")}],
                    "eval_samples": 2,
                    "max_length": 256,
                },
                "extraction": {"store": str(root / "store")},
                "drafter": {"kind": "dflash", "block_size": 4, "num_layers": 1},
                "training": {"pack_length": 512, "run_dir": str(root / "runs")},
                "evaluation": {
                    "num_prompts": 2,
                    "max_new_tokens": 12,
                    "min_acceptance_length": 1.0,
                    "in_vllm": False,
                },
            }
        )
    )
    plan = Plan.load(str(path))
    prepare(plan.recipe.data, plan.data, load_chat_encoder(plan.recipe.target))
    return plan


@pytest.fixture(scope="module")
def checkpoint(recipe, smollm2_dir, tmp_path_factory):
    run_root = tmp_path_factory.mktemp("run")
    return dflash_checkpoint(smollm2_dir, run_root / "export", fixed_token=HA, fingerprint=recipe.fingerprint)


def test_cli_evaluates_the_held_out_prompts(recipe, checkpoint, capsys):
    code = main(
        [
            "evaluate",
            str(checkpoint),
            "--recipe",
            recipe.recipe_path,
            "--no-vllm",
            "--set",
            "evaluation.min_acceptance_length=1.01",
        ]
    )
    out = capsys.readouterr().out
    eval_dir = checkpoint.parent / "eval"
    assert default_eval_dir(checkpoint) == str(eval_dir)
    report = Evaluation.from_dict(json.loads((eval_dir / "report.json").read_text()))
    assert code == (0 if report.passed_gate else 1)
    assert (eval_dir / "report.md").read_text() in out and (eval_dir / "acceptance.png").stat().st_size > 5000
    held_out = load_prepared(recipe.data, EVAL).column("sample_id").to_pylist()
    trained = set(load_prepared(recipe.data, TRAIN).column("sample_id").to_pylist())
    assert report.meta["prompt_ids"] == held_out[:2] and not trained & set(report.meta["prompt_ids"])
    assert report.vllm is None and report.offline.num_prompts == 2 and report.offline.max_new_tokens == 12
    assert report.offline.outputs_identical == 2 and report.contract_problems == []
    assert report.meta["fingerprint"] == recipe.fingerprint


def test_draft_length_option_simulates_a_shorter_served_draft(recipe, checkpoint, tmp_path, capsys):
    args = ["evaluate", str(checkpoint), "--recipe", recipe.recipe_path, "--no-vllm"]
    assert main([*args, "--out", str(tmp_path / "k1"), "--draft-length", "1"]) in (0, 1)
    report = Evaluation.from_dict(json.loads((tmp_path / "k1" / "report.json").read_text()))
    assert report.offline.draft_length == 1 and len(report.offline.per_position) == 1
    assert report.offline.drafts > 0
    assert main([*args, "--out", str(tmp_path / "k4"), "--draft-length", "4"]) == 1
    assert "drafts 1 to 3 tokens, not 4" in capsys.readouterr().err


def test_gate_failure_is_exit_code_one(recipe, checkpoint, tmp_path, capsys):
    code = main(
        [
            "evaluate",
            str(checkpoint),
            "--recipe",
            recipe.recipe_path,
            "--no-vllm",
            "--out",
            str(tmp_path),
            "--set",
            "evaluation.min_acceptance_length=9.5",
            "--set",
            "evaluation.num_prompts=1",
        ]
    )
    assert code == 1 and "FAIL" in capsys.readouterr().out
    assert not Evaluation.from_dict(json.loads((tmp_path / "report.json").read_text())).passed_gate


def test_broken_contract_writes_the_problems_and_raises(recipe, checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    broken = tmp_path / "export"
    broken.mkdir()
    for name in ("model.safetensors", "provenance.json"):
        (broken / name).write_bytes((checkpoint / name).read_bytes())
    config["aux_hidden_state_layer_ids"] = [3, 16, 28]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ContractError, match=r"\[3, 16, 28\] != trained \[2, 15, 27\] \(shifted by one\?\)"):
        evaluate_checkpoint(broken, recipe, in_vllm=False)
    written = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert written["offline"] is None and "(shifted by one?)" in written["contract_problems"][0]
    assert not written["publishable"]


def test_disagreement_raises_after_the_report_is_written(
    recipe, checkpoint, smollm2_model, chat_ids, tmp_path, monkeypatch
):
    """A vLLM report 25% below the simulator's τ (substituted: no server) must raise, report first."""
    import draftflow.evaluation.run as run_module
    from draftflow.evaluation.in_vllm import VLLMResult

    def fake_vllm(checkpoint_dir, prompts, **_):
        offline = run.offline.report
        report = type(offline)(
            **{**offline.__dict__, "source": "vllm", "accepted_tokens": 0, "per_prompt": []}
        )
        return VLLMResult(report, run.offline.outputs, None)

    run = evaluate_prompts(
        checkpoint,
        [chat_ids(QUESTIONS[0])],
        target=recipe.target_model,
        max_new_tokens=12,
        stop_ids=[2],
        min_acceptance_length=1.0,
        agreement_tolerance=0.1,
        model=smollm2_model,
    )
    tau = run.evaluation.offline.mean_acceptance_length
    assert tau > 2
    monkeypatch.setattr(run_module, "evaluate_in_vllm", fake_vllm)
    with pytest.raises(AgreementError) as err:
        evaluate_prompts(
            checkpoint,
            [chat_ids(QUESTIONS[0])],
            target=recipe.target_model,
            max_new_tokens=12,
            stop_ids=[2],
            min_acceptance_length=1.0,
            agreement_tolerance=0.1,
            model=smollm2_model,
            in_vllm=True,
            server_factory=lambda *a: None,
            out_dir=tmp_path,
        )
    assert f"offline τ {tau:.4f}" in str(err.value) and "vLLM τ 1.0000" in str(err.value)
    assert str(tmp_path / "report.json") in str(err.value)
    assert json.loads((tmp_path / "report.json").read_text())["agrees"] is False
