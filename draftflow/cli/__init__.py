"""The `draftflow` command line. Each sub-command lives in its own module and registers here."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterable

from draftflow import __version__
from draftflow.process_env import STORAGE_OPTIONS_ENV, storage_options_from_env
from draftflow.recipe.load import RecipeError

COMMAND_MODULES = ("recipes", "extract", "store", "train", "evaluate", "publish", "releases")


def build_parser(
    extra: Iterable[Callable[[argparse._SubParsersAction], None]] = (),
) -> argparse.ArgumentParser:
    """The core's sub-commands, then each of `extra` given the same sub-command action to add its
    own (flows.cli adds the Prefect ones: the whole command is flows.cli.build_parser)."""
    parser = argparse.ArgumentParser(
        prog="draftflow",
        description="Train speculative-decoding drafters (DFlash, Eagle3) for vLLM from one recipe YAML.",
    )
    parser.add_argument("--version", action="version", version=f"draftflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"draftflow.cli.{name}").register(sub)
    for register in extra:
        register(sub)
    return parser


def add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override validated like the file, e.g. --set drafter.block_size=16 (repeatable)",
    )


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-options",
        dest="storage_options",
        default=None,
        metavar="JSON",
        help="fsspec options of the store as a JSON object, e.g. "
        '\'{"client_kwargs": {"endpoint_url": "http://minio:9000"}}\'; '
        f"default: ${STORAGE_OPTIONS_ENV} (use the variable for credentials: argv is visible to `ps`)",
    )


def storage_options(args: argparse.Namespace) -> dict:
    """--storage-options, else the environment variable, else none."""
    if args.storage_options is None:
        return storage_options_from_env()
    try:
        value = json.loads(args.storage_options)
    except json.JSONDecodeError as err:
        raise RecipeError(f"--storage-options is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise RecipeError("--storage-options must be a JSON object")
    return value


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C: ``finally`` blocks and exit handlers run, so what the command
    started (an ephemeral Prefect server, vLLM servers, torchrun) is stopped, not orphaned."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise SystemExit(128 + signum)


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    exit_on_sigterm()
    try:
        return int(args.func(args) or 0)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
