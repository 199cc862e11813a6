"""The trainer's flags, declared once for its two parsers: `python -m draftflow.train` (the process
torchrun runs) and `draftflow train` (which builds that torchrun command and adds its own flags).

Imports no torch: `python -m draftflow.train --help` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse

from draftflow.cli import add_overrides

# On/off flags the trainer takes as they are: `draftflow train` forwards each one that is on.
SWITCHES = (
    ("--force-new", "move this run id's earlier files aside (RUN_ID.replaced-TIME) and start again"),
    ("--no-export", "skip the export (and the choice of the best validation step): checkpoints only"),
)


def add_trainer_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags both parsers take. `draftflow train` hands the valued ones on through
    :func:`draftflow.train.launch.torchrun_launch`, the switches through :func:`switches_on`
    (tests/train/test_trainer_args.py fails on a flag it does not hand on)."""
    parser.add_argument("recipe", help="a recipe file (e.g. a fork) or a shipped recipe's name")
    add_overrides(parser)
    parser.add_argument(
        "--run-id",
        default="default",
        help="runs with the same id resume each other (several nodes: the same id on every node)",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    parser.add_argument(
        "--init-from",
        default=None,
        metavar="FOLDER",
        help="warm start: begin from the weights and draft vocabulary of this exported drafter "
        "(a local folder; the optimizer starts fresh, refresh.epochs sets the schedule)",
    )
    for flag, help_text in SWITCHES:
        parser.add_argument(flag, action="store_true", help=help_text)


def switches_on(args: argparse.Namespace) -> tuple[str, ...]:
    """The SWITCHES set in ``args``, as the trainer's command line takes them."""
    return tuple(flag for flag, _ in SWITCHES if getattr(args, flag.lstrip("-").replace("-", "_")))
