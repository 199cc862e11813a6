"""The torchrun command that starts the trainer on one node (`draftflow train`, the Prefect task).

One node: `--standalone`. Several nodes (`training.nnodes > 1`): every machine runs the same
command with its own node rank, and torchrun's c10d rendezvous at `training.rdzv_endpoint`
joins them. The node rank decides one thing only: node 0 hosts the rendezvous store
(`is_host=1`), the others connect to it (`is_host=0`). torchrun would otherwise guess the host
by comparing the endpoint with the machine's names and addresses, which fails quietly behind
DNS aliases and containers (every node waits for a store nobody opened) and is ambiguous when
several nodes share one host. Global ranks are still assigned by the rendezvous (c10d ignores
`--node-rank`), so global rank 0 — the rank that writes checkpoints and the export and prints
the result line — may run on any node; the run folder is shared, so that does not matter.

Overrides that may carry a secret go on the command line redacted (any user of the host reads
argv with `ps`) and reach the trainer through its environment (`recipe.redact`).
"""

from __future__ import annotations

import sys

from draftflow.recipe.load import RecipeError
from draftflow.recipe.redact import split_secret_overrides


def check_node_rank(training, node_rank: int) -> None:
    """A node rank outside [0, nnodes) is an error before anything starts."""
    if not 0 <= node_rank < training.nnodes:
        raise RecipeError(
            f"node rank {node_rank} is outside 0..{training.nnodes - 1} (training.nnodes={training.nnodes})"
        )


def rendezvous_id(recipe_name: str, run_id: str) -> str:
    """Same on every node of one job, different between jobs: a node left over from another run
    (or another recipe) that reaches the same endpoint never joins this one."""
    return f"draftflow-{recipe_name}-{run_id}"


def torchrun_launch(
    plan,
    run_id: str,
    *,
    node_rank: int = 0,
    max_steps: int | None = None,
    init_from: str | None = None,
    trainer_args: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv of `torch.distributed.run` for this node and the environment it needs besides the
    current one (the values of secret overrides); `trainer_args` go to `draftflow.train` as they are."""
    t = plan.recipe.training
    check_node_rank(t, node_rank)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={t.nproc}",
        f"--nnodes={t.nnodes}",
    ]
    if t.nnodes > 1:
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={t.rdzv_endpoint}",
            f"--rdzv-id={rendezvous_id(plan.recipe.name, run_id)}",
            f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}",
        ]
    else:
        cmd += ["--standalone"]
    cmd += ["-m", "draftflow.train", plan.recipe_path, "--run-id", run_id]
    overrides, env = split_secret_overrides(plan.overrides)
    for override in overrides:
        cmd += ["--set", override]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    if init_from is not None:
        cmd += ["--init-from", str(init_from)]
    return cmd + list(trainer_args), env
