"""`draftflow releases list | current | rollback DEST --recipe NAME` at a publish destination."""

from __future__ import annotations

import argparse
import sys

from draftflow.cli import add_storage_options, storage_options

_SUBCOMMANDS = {
    "list": "the complete versions of the recipe, newest first; '*' marks the current one",
    "current": "print the folder of the current version (what `vllm serve` loads), checked complete",
    "rollback": "point current at the release before it (or --to VERSION); deletes nothing",
}


def register(sub: argparse._SubParsersAction) -> None:
    releases = sub.add_parser(
        "releases",
        help="which published version is current at a destination; its history; roll back",
        description="Each recipe at an fsspec publish destination has a pointer (NAME.current.json) "
        "and a history (NAME.history.jsonl) beside its version folders NAME-VERSION.",
    )
    rsub = releases.add_subparsers(dest="releases_command", required=True)
    for name, help_text in _SUBCOMMANDS.items():
        p = rsub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "destination", metavar="DEST", help="the publish destination, e.g. s3://bucket/published"
        )
        p.add_argument(
            "--recipe",
            required=True,
            metavar="NAME",
            help="the recipe's name (version folders are NAME-VERSION)",
        )
        if name == "rollback":
            p.add_argument(
                "--to",
                default=None,
                metavar="VERSION",
                help="a complete version (16-hex VERSION or NAME-VERSION) instead of the previous release",
            )
        add_storage_options(p)
        p.set_defaults(func=_run, action=name)


def _run(args: argparse.Namespace) -> int:
    from draftflow.recipe.load import expand
    from draftflow.releases import ReleaseError, Releases

    try:
        releases = Releases(expand(args.destination), args.recipe, storage_options(args))
        return _COMMANDS[args.action](releases, args)
    except ReleaseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def cmd_list(releases, args: argparse.Namespace) -> int:
    from draftflow.releases import ReleaseError

    versions = releases.versions()
    if not versions:
        print(f"no complete version of {releases.recipe} at {releases.dest}", file=sys.stderr)
    for v in versions:
        when = v.published_at[:19].replace("T", " ")
        print(f"{'*' if v.current else ' '} {v.version}  {when}  {v.url}")
    try:
        pointer = releases.pointer()
    except ReleaseError as err:
        print(f"warning: {err}", file=sys.stderr)
        return 0
    if pointer is not None and not any(v.current for v in versions):
        print(f"warning: the current pointer names {pointer.folder}, not a complete version", file=sys.stderr)
    return 0


def cmd_current(releases, args: argparse.Namespace) -> int:
    print(releases.current().url)
    return 0


def cmd_rollback(releases, args: argparse.Namespace) -> int:
    before = releases.pointer()
    release = releases.rollback(args.to)
    if before is not None and before.folder == release.folder:
        print(f"already current: {release.url} (version {release.version}); nothing changed")
    else:
        print(f"rolled back: current is {release.url} (version {release.version}, was {release.previous})")
    return 0


_COMMANDS = {"list": cmd_list, "current": cmd_current, "rollback": cmd_rollback}
