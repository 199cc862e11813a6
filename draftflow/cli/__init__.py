"""The `draftflow` command line. Each sub-command lives in its own module and registers here."""

from __future__ import annotations

import argparse
import sys

from draftflow.recipe.load import RecipeError

COMMAND_MODULES = ("recipes",)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="draftflow",
        description="Train speculative-decoding drafters (DFlash, Eagle3) for vLLM from one recipe YAML.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"draftflow.cli.{name}").register(sub)
    return parser


def add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="dotted override validated like the file, e.g. --set drafter.block_size=16 (repeatable)",
    )


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
