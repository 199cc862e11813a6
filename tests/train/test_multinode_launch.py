"""Multi-node launch without training: the command each node runs, and bad input refused before
anything starts (no torchrun process, no rendezvous, no run folder)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from flows.cli import main as cli_main

MULTINODE = ["--set", "training.nnodes=2", "--set", "training.rdzv_endpoint=127.0.0.1:29511"]
SHARED = ["--set", "training.run_dir_shared=true"]


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = cli_main(["train", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_each_node_gets_the_same_c10d_command_but_only_node_0_hosts_the_rendezvous(train_recipe, capsys):
    commands = []
    for node in (0, 1):
        code, out, err = _cli(
            capsys,
            train_recipe,
            "--node-rank",
            node,
            "--run-id",
            "job7",
            *MULTINODE,
            *SHARED,
            "--print-command",
        )
        assert code == 0, err
        commands.append(shlex.split(out.strip()))
    node0, node1 = commands
    assert node0[:3] == [sys.executable, "-m", "torch.distributed.run"]
    for flag in (
        "--nproc-per-node=1",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29511",
        "--rdzv-id=draftflow-train-test-job7",
    ):
        assert flag in node0 and flag in node1, (flag, node0)
    assert "--rdzv-conf=is_host=1" in node0 and "--rdzv-conf=is_host=0" in node1
    assert "--standalone" not in node0
    # Apart from who hosts the rendezvous, the nodes run the very same trainer command.
    assert [a for a in node0 if "is_host" not in a] == [a for a in node1 if "is_host" not in a]
    trainer = node0[node0.index("draftflow.train") + 1 :]
    assert trainer[:3] == [str(train_recipe), "--run-id", "job7"] and "training.nnodes=2" in trainer


def test_one_node_stays_standalone(train_recipe, capsys):
    code, out, err = _cli(capsys, train_recipe, "--set", "training.nproc=2", "--no-export", "--print-command")
    assert code == 0, err
    cmd = shlex.split(out.strip())
    assert "--standalone" in cmd and "--nproc-per-node=2" in cmd and cmd[-1] == "--no-export"
    assert not any(a.startswith("--rdzv") for a in cmd)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "training.nnodes=2"], ["training", "nnodes > 1 needs `rdzv_endpoint`"]),
        (
            ["--set", "training.nnodes=2", "--set", "training.rdzv_endpoint=head-node"],
            ["training", "is not host:port"],
        ),
        (MULTINODE, ["training", "is a path on one machine", "run_dir_shared: true", "s3://"]),
        (MULTINODE + SHARED + ["--node-rank", "2"], ["node rank 2 is outside 0..1"]),
        (["--node-rank", "1"], ["node rank 1 is outside 0..0"]),
    ],
    ids=[
        "no-endpoint",
        "endpoint-without-port",
        "node-local-run-dir",
        "node-rank-too-high",
        "single-node-rank-1",
    ],
)
def test_bad_multinode_input_is_one_line_before_anything_starts(train_recipe, capsys, args, expected):
    # Without --print-command: a recipe that passed would exec torchrun here, so exit 2 proves
    # that the error came first.
    code, out, err = _cli(capsys, train_recipe, *args)
    assert code == 2 and not out
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for part in expected:
        assert part in err, err
    assert not (train_recipe.parent / "runs").exists()


def test_a_run_dir_on_an_object_store_needs_no_declaration(train_recipe, capsys, monkeypatch):
    # Credentials of its own: the check for them runs before the command is printed.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    code, out, err = _cli(
        capsys, train_recipe, *MULTINODE, "--set", "training.run_dir=s3://team/runs", "--print-command"
    )
    assert code == 0, err


def test_the_prefect_train_task_starts_the_node_it_is_given(train_recipe, capsys):
    from draftflow.run_ref import RunRef
    from tasks.train import node_launch

    ref, _ = RunRef.create(str(train_recipe), MULTINODE[1::2] + SHARED[1::2])
    _, task_cmd, env = node_launch(ref, "job7", node_rank=1, max_steps=3)
    code, out, err = _cli(
        capsys,
        train_recipe,
        "--node-rank",
        1,
        "--run-id",
        "job7",
        *MULTINODE,
        *SHARED,
        "--max-steps",
        3,
        "--print-command",
    )
    assert code == 0, err
    assert task_cmd == shlex.split(out.strip())  # what `draftflow train` runs on that machine
    assert "--rdzv-conf=is_host=0" in task_cmd and env == ref.to_env()  # the reference, no secret
    with pytest.raises(Exception, match="node rank 2 is outside 0..1"):
        node_launch(ref, "job7", node_rank=2)


def test_a_node_without_global_rank_0_points_the_task_at_the_shared_run_folder(train_recipe):
    from draftflow.paths import RunLayout
    from draftflow.plan import Plan
    from tasks.train import _other_node_result

    plan = Plan.load(str(train_recipe), MULTINODE[1::2] + SHARED[1::2])
    layout = RunLayout.for_run(plan.recipe.training.run_dir, plan.recipe.name, plan.fingerprint, "job7")
    before = _other_node_result(plan, "job7", 1)
    assert (before.node_rank, before.result_on_another_node) == (1, True)
    assert (before.run_dir, before.export_dir) == (layout.root, None)
    Path(layout.export_dir).mkdir(parents=True)  # rank 0's export, written on the other node
    assert _other_node_result(plan, "job7", 1).export_dir == layout.export_dir
