"""`draftflow publish CHECKPOINT --report R [--to URL|hf://OWNER/REPO] [--public]`."""

from __future__ import annotations

import argparse
import os
import sys

from draftflow.cli import add_storage_options, storage_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "publish",
        help="check an evaluated checkpoint, write its model card and push it (once per version)",
        description="Refuses (exit 1, nothing pushed) unless the report measured exactly this checkpoint "
        "and it passed: gate, offline/vLLM agreement, contract. Without --to only the card is written.",
    )
    p.add_argument("checkpoint", help="the exported speculators folder that was evaluated")
    p.add_argument("--report", required=True, help="its evaluation's report.json (acceptance.png beside it)")
    p.add_argument(
        "--to",
        dest="destination",
        default=None,
        metavar="URL",
        help="fsspec folder URL (a sub-folder per version) or hf://OWNER/REPO "
        "(token: $HF_TOKEN; add ?private=false or --public for a public new repo)",
    )
    p.add_argument("--public", action="store_true", help="create a new Hub repo public (default: private)")
    add_storage_options(p)
    p.set_defaults(func=cmd_publish)


def cmd_publish(args) -> int:
    from draftflow.publish import Destination, PublishRefused, publish  # torch: not at CLI start-up

    destination = None
    if args.destination:
        destination = Destination.parse(
            args.destination,
            storage_options=storage_options(args),
            hf_token=os.environ.get("HF_TOKEN"),
            private=not args.public,
        )
    try:
        published = publish(args.checkpoint, args.report, destination)
    except PublishRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if published.kept:
        print(f"kept the drafter in service, {published.kept}: {'; '.join(published.reasons)}")
    elif published.location is None:
        print(f"checked; model card written into {args.checkpoint} (no --to: nothing pushed)")
    else:
        state = "published" if published.pushed else "already published"
        print(f"{state}: {published.location} (version {published.version})")
    return 0
