"""`draftflow deploy` and the shipped prefect.yaml, against a real Prefect server; a deployment made by
`draftflow deploy` runs on a real process worker (no image, no remote storage: this folder)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from prefect_helpers import PREFECT, REPO, trigger, wait_final, write_tiny_recipe

from draftflow.plan import Plan
from draftflow.store import Store, read_manifest
from flows.cli import main as cli_main
from flows.deploy import DEFAULT_POOL, ensure_process_pool

SHIPPED = "recipes/smollm2-135m-dflash-cpu.yaml"


def read_deployment(name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(name)
        return deployment, client.read_work_pool(deployment.work_pool_name)


@pytest.mark.slow
def test_deploy_creates_then_updates_a_scheduled_deployment(prefect_server, tmp_path: Path, capsys):
    fork = tmp_path / "my-recipe.yaml"
    assert cli_main(["recipes", "cp", "smollm2-135m-dflash-cpu", str(fork)]) == 0
    pool, name = f"pool-{uuid.uuid4().hex[:6]}", f"nightly-{uuid.uuid4().hex[:6]}"
    argv = [
        "deploy",
        str(fork),
        "--cron",
        "0 2 * * *",
        "--name",
        name,
        "--pool",
        pool,
        "--set",
        "training.epochs=1",
        "--store-block",
        "team-store",
    ]
    assert cli_main(argv) == 0
    assert f"on work pool '{pool}', cron '0 2 * * *' (UTC)" in capsys.readouterr().out
    deployment, work_pool = read_deployment(f"draftflow-pipeline/{name}")
    assert work_pool.type == "process"  # created because it was missing
    assert deployment.entrypoint == "flows/pipeline.py:pipeline"
    assert deployment.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ]
    assert deployment.parameters == {
        "recipe": str(fork),
        "overrides": ["training.epochs=1"],
        "store_block": "team-store",
    }
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in deployment.schedules] == [
        ("0 2 * * *", "UTC", True)
    ]
    assert deployment.global_concurrency_limit is None  # no traffic windows: runs may overlap

    assert (
        cli_main(
            [
                "deploy",
                str(fork),
                "--cron",
                "30 3 * * 1-5",
                "--timezone",
                "Europe/Paris",
                "--name",
                name,
                "--pool",
                pool,
            ]
        )
        == 0
    )
    updated, _ = read_deployment(f"draftflow-pipeline/{name}")
    assert updated.id == deployment.id  # the same deployment, updated in place
    assert [(s.schedule.cron, s.schedule.timezone) for s in updated.schedules] == [
        ("30 3 * * 1-5", "Europe/Paris")
    ]
    assert updated.parameters == {"recipe": str(fork), "overrides": []}

    assert cli_main(["deploy", "no-such-recipe", "--pool", pool]) == 2
    assert "no such recipe file or shipped recipe" in capsys.readouterr().err
    assert cli_main(["deploy", str(fork), "--pool", pool, "--set", "drafter.block_size=banana"]) == 2
    assert cli_main(["deploy", str(fork), "--pool", pool, "--flow", "train", "--destination-block", "x"]) == 2


@pytest.mark.slow
def test_a_multinode_recipe_gets_one_train_deployment_per_node(
    prefect_server, tmp_path: Path, capsys, monkeypatch
):
    from flows.stages import train

    # the run folder is on S3: the recipe validates only with credentials (any, nothing is written)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    fork = tmp_path / "multi.yaml"
    assert cli_main(["recipes", "cp", "smollm2-135m-dflash-cpu", str(fork)]) == 0
    overrides = [
        "training.nnodes=2",
        "training.rdzv_endpoint=node-0:29400",
        "training.run_dir=s3://team/runs",
    ]
    pool = f"pool-{uuid.uuid4().hex[:6]}"
    sets = [a for o in overrides for a in ("--set", o)]
    for node in (0, 1):
        argv = [
            "deploy",
            str(fork),
            "--flow",
            "train",
            "--name",
            f"multi-node-{node}",
            "--pool",
            f"{pool}-{node}",
        ]
        assert cli_main(argv + ["--node-rank", str(node), "--run-id", "job-1", *sets]) == 0
        deployment, _ = read_deployment(f"draftflow-train/multi-node-{node}")
        assert deployment.work_pool_name == f"{pool}-{node}"  # a pool per machine: its worker runs there
        assert deployment.parameters == {
            "recipe": str(fork),
            "overrides": overrides,
            "node_rank": node,
            "run_id": "job-1",
        }
    capsys.readouterr()
    assert cli_main(["deploy", str(fork), "--flow", "train", "--pool", pool, "--node-rank", "2", *sets]) == 2
    assert "node rank 2 is outside 0..1" in capsys.readouterr().err
    assert cli_main(["deploy", str(fork), "--pool", pool, "--node-rank", "0", *sets]) == 2
    assert "belong to the train flow" in capsys.readouterr().err
    # Each flow run has its own id: without a shared run_id the nodes would never meet.
    with pytest.raises(ValueError, match="pass the same run_id to the train flow run of every node"):
        train(str(fork), overrides, node_rank=1)


@pytest.mark.slow
def test_the_shipped_refresh_recipe_deploys_with_its_cron_schedule(prefect_server, capsys):
    """The refresh recipe as its header says to deploy it: one pipeline deployment, scheduled."""
    recipe = REPO / "recipes" / "smollm2-135m-dflash-cpu-refresh.yaml"
    cron = next(line for line in recipe.read_text().splitlines() if "draftflow deploy" in line)
    cron = cron.split("--cron", 1)[1].strip().strip('"')
    pool, name = f"pool-{uuid.uuid4().hex[:6]}", f"refresh-{uuid.uuid4().hex[:6]}"
    assert cli_main(["deploy", str(recipe), "--cron", cron, "--name", name, "--pool", pool]) == 0
    assert f"cron '{cron}' (UTC)" in capsys.readouterr().out
    deployment, _ = read_deployment(f"draftflow-pipeline/{name}")
    assert deployment.parameters == {"recipe": str(recipe), "overrides": []}
    assert [(s.schedule.cron, s.active) for s in deployment.schedules] == [(cron, True)]
    # one run at a time: a run due while one is running waits (windows follow each other)
    assert deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy == "ENQUEUE"
    plan = Plan.load(str(recipe), segment="new")  # what its first run reads
    assert plan.recipe.data.traffic is not None and plan.window is not None


@pytest.mark.slow
def test_shipped_prefect_yaml(prefect_server):
    from prefect.cli.deploy._models import PrefectYamlModel

    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    PrefectYamlModel.model_validate(config)  # the schema `prefect deploy` reads it with
    (entry,) = config["deployments"]
    assert entry["entrypoint"] == "flows/pipeline.py:pipeline"
    assert entry["parameters"]["recipe"] == SHIPPED and (REPO / SHIPPED).is_file()
    assert entry["work_pool"]["name"] == DEFAULT_POOL
    assert [s["cron"] for s in entry["schedules"]] == ["0 2 * * *"]

    ensure_process_pool(DEFAULT_POOL)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        **prefect_server.env(),
        "PREFECT_HOME": str(prefect_server.home / "cli"),
    }
    done = subprocess.run(
        [PREFECT, "--no-prompt", "deploy", "--all"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    deployment, pool = read_deployment(f"draftflow-pipeline/{entry['name']}")
    assert pool.type == "process" and deployment.work_pool_name == DEFAULT_POOL
    assert deployment.parameters["recipe"] == SHIPPED
    assert [s.schedule.cron for s in deployment.schedules] == ["0 2 * * *"]
    assert deployment.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ]
    assert Plan.load(str(REPO / SHIPPED)).recipe.name == "smollm2-135m-dflash-cpu"


@pytest.mark.slow
def test_deployed_flow_runs_on_a_process_worker(
    prefect_server, start_process, extraction_endpoint, staging_dir, smollm2_dir: Path, tmp_path: Path
):
    recipe = write_tiny_recipe(
        tmp_path / "recipe.yaml",
        smollm2_dir,
        str(tmp_path / "store"),
        extraction_endpoint,
        name="prefect-worker",
        staging=str(staging_dir),
    )
    pool = f"pool-{uuid.uuid4().hex[:6]}"
    assert cli_main(["deploy", recipe, "--flow", "extract", "--name", "on-worker", "--pool", pool]) == 0
    worker = start_process([PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--limit", "1"])
    run = wait_final(trigger("draftflow-extract/on-worker"), timeout_s=240)
    assert run.state.type.value == "COMPLETED", worker.output()[-3000:]
    assert len(read_manifest(Store(Plan.load(recipe).data))) == 20
