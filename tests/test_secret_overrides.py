"""Secrets given as `--set` overrides (a launch env value, an `--api-key` in extra_args) stay out of
`draftflow recipes show`, out of torchrun's command line (they travel in its environment), and come
back whole, in their place, where the recipe is loaded."""

from __future__ import annotations

import json
import shlex
import uuid
from pathlib import Path

import pytest
import yaml

from draftflow.cli import main as cli_main


def planted(what: str) -> str:
    return f"planted-{what}-{uuid.uuid4().hex}"


@pytest.fixture
def recipe(tmp_path: Path, smollm2_dir: Path) -> str:
    data = {
        "name": "secret-overrides",
        "target": {"model": str(smollm2_dir)},
        "data": {"sources": [{"kind": "chatterbot", "max_samples": 8}], "max_length": 64},
        "extraction": {"dtype": "float32", "samples_per_shard": 4, "store": str(tmp_path / "store")},
        "vllm": {"endpoints": ["http://127.0.0.1:9"], "launch": {"device": "cpu", "env": {"A": "b"}}},
        "drafter": {"kind": "dflash", "block_size": 4, "num_layers": 1, "draft_vocab_size": 512},
        "training": {"device": "cpu", "run_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def secret_sets(token: str, api_key: str) -> list[str]:
    return [
        "--set",
        f"vllm.launch.env.HF_TOKEN={token}",
        "--set",
        f"vllm.launch.extra_args=[--api-key, {api_key}, --max-num-seqs, '4']",
    ]


def test_recipes_show_prints_stars_for_secret_overrides(recipe: str, capsys):
    token, api_key = planted("hf-token"), planted("api-key")
    assert cli_main(["recipes", "show", recipe, *secret_sets(token, api_key)]) == 0
    out = capsys.readouterr().out
    assert token not in out and api_key not in out
    shown = yaml.safe_load(out)["vllm"]["launch"]
    assert shown["env"] == {"A": "**********", "HF_TOKEN": "**********"}  # names stay, values go
    assert shown["extra_args"] == ["--api-key", "**********", "--max-num-seqs", "4"]


def test_torchrun_gets_secret_overrides_through_its_environment(recipe: str, capsys):
    from draftflow.plan import Plan
    from draftflow.recipe.redact import SECRET_OVERRIDES_ENV
    from draftflow.train.launch import torchrun_launch

    token, api_key = planted("hf-token"), planted("api-key")
    sets = [*secret_sets(token, api_key), "--set", "training.epochs=3"]
    assert cli_main(["train", recipe, *sets, "--print-command"]) == 0
    out, err = capsys.readouterr()
    assert token not in out + err and api_key not in out + err
    assert SECRET_OVERRIDES_ENV in err  # says where the trainer reads them from
    argv = shlex.split(out.strip())
    trainer = argv[argv.index("draftflow.train") :]
    assert trainer[trainer.index("--set") :][:6] == [
        "--set",
        "vllm.launch.env.HF_TOKEN=**********",
        "--set",
        "vllm.launch.extra_args=**********",
        "--set",
        "training.epochs=3",
    ]  # every override keeps its place: a later one may replace part of a secret's section

    overrides = sets[1::2]
    cmd, env = torchrun_launch(Plan.load(recipe, overrides), "r1")
    assert token not in " ".join(cmd) and api_key not in " ".join(cmd)
    assert json.loads(env[SECRET_OVERRIDES_ENV]) == overrides[:2]


def test_the_trainer_restores_secret_overrides_in_place_or_names_the_missing_one(recipe: str, monkeypatch):
    from draftflow.plan import Plan
    from draftflow.recipe.load import RecipeError
    from draftflow.recipe.redact import (
        SECRET_OVERRIDES_ENV,
        is_secret_override,
        restore_secret_overrides,
        split_secret_overrides,
    )

    token = planted("hf-token")
    overrides = [
        f"vllm.launch={{device: cpu, env: {{HF_TOKEN: {token}}}}}",  # a section holding a secret
        "vllm.launch.max_model_len=512",  # applied after it, so it must stay after it
        "vllm.launch.device=cpu",
    ]
    assert [is_secret_override(o) for o in overrides] == [True, False, False]
    assert not is_secret_override("vllm.launch={device: cpu}")
    shown, env = split_secret_overrides(overrides)
    assert token not in json.dumps(shown) and shown[1:] == overrides[1:]
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, env[SECRET_OVERRIDES_ENV])
    assert restore_secret_overrides(shown) == overrides
    launch = Plan.load(recipe, restore_secret_overrides(shown)).recipe.vllm.launch
    assert launch.env == {"HF_TOKEN": token} and launch.max_model_len == 512

    monkeypatch.delenv(SECRET_OVERRIDES_ENV)
    with pytest.raises(RecipeError, match=rf"vllm.launch=\*{{10}}: .*{SECRET_OVERRIDES_ENV}") as info:
        restore_secret_overrides(shown)
    assert token not in str(info.value)
