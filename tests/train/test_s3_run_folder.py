"""A shipped GPU recipe's storage layout on the CPU stack: hidden-state store AND run folder on the
loopback S3 (moto), credentials only through $DRAFTFLOW_STORAGE_OPTIONS (never argv, no AWS_* in
the trainer's environment). Train, kill-free resume, export, contract check, offline evaluation and
publishing all read and write s3:// through the store's storage options."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import fsspec
import pytest
import yaml
from test_trainer import TRAIN

from draftflow.evaluation.run import evaluate_checkpoint
from draftflow.paths import (
    CHECKPOINT_COMPLETE,
    EXPORT_CONFIG,
    EXPORT_SELECTION,
    EXPORT_WEIGHTS,
    PROVENANCE,
    RunLayout,
    remote_copy,
    remote_copy_stamp,
)
from draftflow.plan import Plan
from draftflow.process_env import STORAGE_OPTIONS_ENV
from draftflow.publish import PUBLISHED_MARKER, Destination, publish
from draftflow.recipe.load import default_home
from draftflow.remote import local_copy, put_folder
from draftflow.train import RESULT_PREFIX
from draftflow.train.metrics import parse_line

pytestmark = pytest.mark.slow


def _trainer_env(options: dict) -> dict:
    """Credentials and endpoint only in $DRAFTFLOW_STORAGE_OPTIONS: the AWS_* the s3 fixture set
    for this process are removed, so nothing else could have let the trainer in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "OMP_NUM_THREADS": "1", STORAGE_OPTIONS_ENV: json.dumps(options)}


def _train(recipe: str, options: dict, *args: str) -> tuple[list[dict], dict, str]:
    proc = subprocess.run(
        TRAIN + [recipe, "--run-id", "s3", *args],
        capture_output=True,
        text=True,
        env=_trainer_env(options),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.dumps(options["secret"]) not in " ".join(TRAIN + [recipe, *args])
    lines = proc.stdout.splitlines()
    result = json.loads(next(ln for ln in lines if ln.startswith(RESULT_PREFIX))[len(RESULT_PREFIX) :])
    return [m for m in map(parse_line, lines) if m], result, proc.stderr


def test_store_and_run_folder_on_s3_train_resume_export_evaluate_and_publish(train_store_dir, tmp_path, s3):
    options = s3["storage_options"]
    prefix = f"{s3['url']}/s3run-{uuid.uuid4().hex[:8]}"
    put_folder(train_store_dir / "store", f"{prefix}/store", options)  # the real filled store, on S3
    recipe_data = yaml.safe_load((train_store_dir / "recipe.yaml").read_text())
    recipe_data["extraction"]["store"] = f"{prefix}/store"
    recipe_data["training"].update(run_dir=f"{prefix}/runs", epochs=2, checkpoint_every=2)
    recipe_data["evaluation"] = {"num_prompts": 2, "max_new_tokens": 12, "in_vllm": False}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_data))
    fs = fsspec.filesystem("s3", **options)

    # First run stops at step 3 (a checkpoint at step 2); the rerun resumes it from S3.
    first, stopped, _ = _train(str(recipe), options, "--max-steps", "3", "--no-export")
    assert stopped["steps"] == 3 and stopped["export_dir"] is None
    layout = RunLayout(stopped["run_dir"])
    assert layout.root.startswith(prefix + "/runs/")
    assert fs.exists(layout.checkpoint(2) + "/" + CHECKPOINT_COMPLETE)
    assert not fs.exists(layout.lock), "the lease object is removed when the trainer ends"

    metrics, result, stderr = _train(str(recipe), options)
    assert result["resumed_from"] == layout.checkpoint(2)
    assert metrics[0]["step"] == 3 and result["steps"] > 4
    logged = [json.loads(ln) for ln in fs.cat_file(layout.metrics).decode().splitlines()]
    assert sorted({m["step"] for m in logged}) == list(range(1, result["steps"] + 1))
    assert len([m for m in logged if m["step"] == 3 and "loss" in m]) == 1  # step 3 of the first run dropped
    assert json.loads(fs.cat_file(layout.settings))["training"]["epochs"] == 2
    assert fs.exists(layout.best_record) and fs.ls(layout.tensorboard_dir)
    assert fs.exists(layout.training_curves) and not fs.exists(layout.lock)
    export = result["export_dir"]
    assert export == layout.export_dir
    for name in (EXPORT_CONFIG, EXPORT_WEIGHTS, PROVENANCE, EXPORT_SELECTION):
        assert fs.exists(f"{export}/{name}"), name
    vocab = Plan.load(str(recipe), storage_options=options).data.draft_vocab(2048)
    assert fs.exists(vocab), "the draft vocabulary is cached in the S3 store"

    home = str(default_home())
    copies = [(remote_copy(u, home), remote_copy_stamp(u, home)) for u in (export, layout.eval_dir)]
    try:
        evaluation = evaluate_checkpoint(export, str(recipe), storage_options=options)
        assert evaluation.checkpoint == export and evaluation.contract_problems == []
        assert evaluation.offline.num_prompts == 2 and evaluation.tau >= 1.0
        report = json.loads(fs.cat_file(layout.eval_report))  # written beside export/, on S3
        assert report["checkpoint"] == export
        # Unchanged on S3: the second use reads the local copy it already has.
        copy = local_copy(export, options)
        before = (copy / EXPORT_WEIGHTS).stat().st_mtime_ns
        assert local_copy(export, options) == copy and (copy / EXPORT_WEIGHTS).stat().st_mtime_ns == before

        destination = Destination.parse(f"{prefix}/published", storage_options=options)
        published = publish(export, layout.eval_report, destination, storage_options=options)
        assert published.pushed and published.location.startswith(f"{prefix}/published/")
        assert fs.exists(f"{published.location}/{PUBLISHED_MARKER}")
        assert fs.exists(f"{published.location}/{EXPORT_WEIGHTS}")
        assert not fs.exists(f"{export}/README.md"), "the card goes to the destination, not the run folder"
    finally:  # the local copies live in $DRAFTFLOW_HOME: do not leave them behind
        for folder, stamp in copies:
            shutil.rmtree(folder, ignore_errors=True)
            if os.path.exists(stamp):
                os.remove(stamp)
