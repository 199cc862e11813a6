"""`draftflow train RECIPE [--node-rank K] [--run-id ID] [--set k=v] [--print-command]`.

Validates the recipe, builds this node's torchrun command (draftflow.train.launch) and
becomes it (exec): signals sent to this process reach torchrun directly, as if it had been
typed. On several machines, run the same command on each with its own `--node-rank`
(node 0 on the machine named by `training.rdzv_endpoint`) and the same `--run-id`.
The flags it hands on to the trainer are declared once, in :mod:`draftflow.train.args`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from draftflow.train.args import add_trainer_arguments, switches_on


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train the recipe's drafter with torchrun on this node (one command per node)"
    )
    add_trainer_arguments(p)
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's node, 0..training.nnodes-1; node 0 hosts the rendezvous (default 0)",
    )
    p.add_argument("--print-command", action="store_true", help="print the torchrun command and exit")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from draftflow.recipe.redact import SECRET_OVERRIDES_ENV
    from draftflow.run_ref import RunRef
    from draftflow.train.launch import torchrun_launch

    ref, plan = RunRef.create(args.recipe, args.overrides)  # RecipeError: one line, exit 2, nothing started
    cmd, env = torchrun_launch(
        plan,
        args.run_id,
        node_rank=args.node_rank,
        max_steps=args.max_steps,
        init_from=args.init_from,
        trainer_args=switches_on(args),
    )
    env |= ref.to_env()  # the trainer plans what was validated here (draftflow.run_ref)
    if args.print_command:
        print(shlex.join(cmd))
        if env:
            print(
                f"note: the values of the overrides shown as ********** are not printed; the trainer "
                f"reads them from ${SECRET_OVERRIDES_ENV} (a JSON list of KEY=VALUE)",
                file=sys.stderr,
            )
        return 0
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 1  # not reached
