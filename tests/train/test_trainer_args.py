"""The trainer's flags are declared once (draftflow.train.args): `python -m draftflow.train` and
`draftflow train` take the same ones with the same help, and `draftflow train` hands every one of
them on to the trainer it starts."""

from __future__ import annotations

import argparse
import shlex

from draftflow.cli import build_parser as cli_parser
from draftflow.cli import main as cli_main
from draftflow.train.__main__ import build_parser as trainer_parser
from draftflow.train.args import SWITCHES

LAUNCHER_ONLY = {"--node-rank", "--print-command"}  # `draftflow train`'s own: the trainer never sees them


def _arguments(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        (a.option_strings[0] if a.option_strings else a.dest): a
        for a in parser._actions  # argparse has no public list of a parser's arguments
        if not isinstance(a, argparse._HelpAction)
    }


def _declared(action: argparse.Action) -> tuple:
    return (
        type(action).__name__,
        tuple(action.option_strings),
        action.dest,
        action.help,
        action.default,
        action.type,
        action.nargs,
        action.metavar,
    )


def _train_subcommand() -> argparse.ArgumentParser:
    [sub] = [a for a in cli_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["train"]


def test_both_parsers_declare_the_same_trainer_flags_with_one_help_each():
    trainer = _arguments(trainer_parser())
    launcher = _arguments(_train_subcommand())
    assert set(launcher) - set(trainer) == LAUNCHER_ONLY
    assert {name: _declared(a) for name, a in trainer.items()} == {
        name: _declared(launcher[name]) for name in trainer if name in launcher
    }
    assert all(a.help for a in launcher.values()), "every flag says what it does"


def test_draftflow_train_hands_every_trainer_flag_on_to_the_trainer(train_recipe, capsys):
    argv = [
        str(train_recipe),
        "--set",
        "training.lr=0.002",
        "--run-id",
        "job3",
        "--max-steps",
        "5",
        "--init-from",
        "/models/in-service",
        *(flag for flag, _ in SWITCHES),
    ]
    launched = cli_parser().parse_args(["train", *argv])
    trainer = _arguments(trainer_parser()).values()
    unset = [a.dest for a in trainer if getattr(launched, a.dest) == a.default]
    assert not unset, f"give these a value above, so that forwarding them is checked: {unset}"

    assert cli_main(["train", *argv, "--print-command"]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip())
    received = trainer_parser().parse_args(cmd[cmd.index("draftflow.train") + 1 :])
    assert {a.dest: getattr(received, a.dest) for a in trainer} == {
        a.dest: getattr(launched, a.dest) for a in trainer
    }
