"""An s3:// store, run folder or destination without credentials is one line naming the field, at
plan time: in the core, the `draftflow extract` CLI, the trainer and the flows' first task, before
any server starts. Credentials count from the store block's options, $DRAFTFLOW_STORAGE_OPTIONS,
fsspec's config and botocore's own chain (AWS_* variables, profiles); never from argv."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import yaml

from draftflow.plan import NOT_THE_STORE, Plan
from draftflow.process_env import STORAGE_OPTIONS_ENV
from draftflow.recipe.load import RecipeError

REPO = Path(__file__).resolve().parents[1]
KEYS = {"key": "AKIDEXAMPLE", "secret": "never-in-argv"}


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """Nothing anywhere: no AWS_* variables, no shared files, no instance metadata, no options."""
    import os

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # this host is no EC2 instance
    monkeypatch.delenv(STORAGE_OPTIONS_ENV, raising=False)
    monkeypatch.delitem(fsspec.config.conf, "s3", raising=False)


def _recipe(tmp_path: Path, smollm2_dir: Path, *, store: str, run_dir: str, destination: str | None = None):
    data = {
        "name": "creds",
        "target": {"model": str(smollm2_dir)},
        "data": {"sources": [{"kind": "chatterbot", "max_samples": 8}], "max_length": 64},
        "extraction": {"store": store},
        "vllm": {"endpoints": ["http://127.0.0.1:9"]},
        "drafter": {"kind": "dflash", "block_size": 4},
        "training": {"run_dir": run_dir, "pack_length": 128},
        "publish": {"destination": destination},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_s3_folders_without_credentials_fail_at_plan_time_in_one_line(tmp_path, smollm2_dir, no_credentials):
    recipe = _recipe(tmp_path, smollm2_dir, store="s3://bucket/hs", run_dir="s3://bucket/runs")
    with pytest.raises(RecipeError) as err:
        Plan.load(recipe)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{recipe}: ")
    assert (
        "extraction.store (s3://bucket/hs), training.run_dir (s3://bucket/runs): no S3 credentials" in message
    )
    assert STORAGE_OPTIONS_ENV in message and "AWS_ACCESS_KEY_ID" in message


def test_each_place_credentials_may_come_from_is_accepted(tmp_path, smollm2_dir, no_credentials, monkeypatch):
    local = str(tmp_path / "store")
    recipe = _recipe(tmp_path, smollm2_dir, store=local, run_dir="s3://bucket/runs")
    Plan.load(recipe, storage_options=KEYS)  # the store block's options
    Plan.load(recipe, storage_options={"anon": True})  # a public bucket
    with monkeypatch.context() as m:
        m.setenv(STORAGE_OPTIONS_ENV, json.dumps(KEYS))
        Plan.load(recipe)
    with monkeypatch.context() as m:
        m.setenv("AWS_ACCESS_KEY_ID", KEYS["key"])
        m.setenv("AWS_SECRET_ACCESS_KEY", KEYS["secret"])
        Plan.load(recipe)
    with monkeypatch.context() as m:
        credentials = tmp_path / "aws-credentials"
        credentials.write_text(f"[team]\naws_access_key_id = {KEYS['key']}\naws_secret_access_key = x\n")
        m.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
        m.setenv("AWS_PROFILE", "team")
        Plan.load(recipe)
    with monkeypatch.context() as m:
        m.setitem(fsspec.config.conf, "s3", dict(KEYS))  # FSSPEC_S3_* variables end up here
        Plan.load(recipe)
    with pytest.raises(RecipeError, match=r"training.run_dir \(s3://bucket/runs\): AWS profile 'nope'"):
        Plan.load(recipe, storage_options={"profile": "nope"})


def test_a_destination_without_credentials_is_named_unless_a_block_replaces_it(
    tmp_path, smollm2_dir, no_credentials
):
    local = str(tmp_path / "x")
    recipe = _recipe(tmp_path, smollm2_dir, store=local, run_dir=local, destination="s3://releases/drafters")
    with pytest.raises(
        RecipeError, match=r"publish.destination \(s3://releases/drafters\): no S3 credentials"
    ):
        Plan.load(recipe)
    Plan.load(recipe, skip_storage=("publish.destination",))
    hub = _recipe(tmp_path, smollm2_dir, store=local, run_dir=local, destination="hf://org/repo")
    Plan.load(hub)  # the Hub has its own token (destination block or $HF_TOKEN)
    store_only = _recipe(tmp_path, smollm2_dir, store=local, run_dir="s3://bucket/runs")
    Plan.load(store_only, skip_storage=NOT_THE_STORE)  # `draftflow extract`, `store`: the store only


def _clean_env(tmp_path: Path) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != STORAGE_OPTIONS_ENV}
    return {
        **env,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@pytest.mark.slow
def test_trainer_and_extract_command_refuse_in_one_line_before_any_server(tmp_path, smollm2_dir):
    recipe = _recipe(tmp_path, smollm2_dir, store="s3://bucket/hs", run_dir="s3://bucket/runs")
    env = _clean_env(tmp_path)
    train = subprocess.run(
        [sys.executable, "-m", "draftflow.train", recipe],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert train.returncode == 2, train.stderr[-2000:]
    assert (
        train.stderr.count("\n") == 1
        and "training.run_dir (s3://bucket/runs): no S3 credentials" in train.stderr
    )
    extract = subprocess.run(
        [sys.executable, "-m", "flows.cli", "extract", recipe],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert extract.returncode == 2, extract.stderr[-2000:]
    assert extract.stderr.count("\n") == 1 and "extraction.store (s3://bucket/hs): no S3" in extract.stderr
    assert "127.0.0.1:9" not in extract.stderr + extract.stdout  # no server was asked or started


@pytest.mark.slow
def test_the_flows_first_task_refuses_and_a_store_blocks_keys_let_it_through(
    tmp_path, smollm2_dir, no_credentials
):
    from draftflow.run_ref import RunRef
    from tasks.recipe import resolve_run

    recipe = _recipe(tmp_path, smollm2_dir, store="s3://bucket/hs", run_dir="s3://bucket/runs")
    with pytest.raises(RecipeError, match="training.run_dir"):
        resolve_run.fn(recipe, [])  # no store block: nothing in the environment either
    RunRef.create(recipe, [], storage_options=dict(KEYS))  # what a store block resolves to
