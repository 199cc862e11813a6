"""The full `draftflow` command: the core commands plus those that run Prefect flows.

The core package's CLI (`draftflow.cli`) knows nothing about Prefect; this module adds the
flow-backed commands on top of it, keeping imports one-way (core <- tasks <- flows).
"""

from __future__ import annotations

import argparse
import sys

from draftflow.cli import add_overrides, run
from draftflow.cli import build_parser as build_core_parser


def _pipeline(args) -> int:
    import os

    from draftflow.recipe.redact import split_secret_overrides
    from flows.pipeline import pipeline

    # Flow-run parameters are stored and shown: secret values reach the tasks through the
    # environment, the parameters hold them starred (draftflow.recipe.redact).
    overrides, secret_env = split_secret_overrides(args.overrides)
    os.environ.update(secret_env)
    result = pipeline(recipe=args.recipe, overrides=overrides)
    print(result.summary())
    return 0


def _blocks_register(args) -> int:
    from blocks.infrastructure import register_all

    for slug in register_all():
        print(f"registered block type {slug}")
    return 0


def _deploy(args) -> int:
    from flows.deploy import deploy

    blocks = {
        "store_block": args.store_block,
        "vllm_block": args.vllm_block,
        "destination_block": args.destination_block,
    }
    deployment_id = deploy(
        args.recipe,
        cron=args.cron,
        timezone=args.timezone,
        name=args.name,
        pool=args.pool,
        overrides=list(args.overrides),
        flow=args.flow,
        blocks=blocks,
        paused=args.paused,
        node_rank=args.node_rank,
        run_id=args.run_id,
    )
    schedule = (
        f"cron {args.cron!r} ({args.timezone or 'UTC'})" if args.cron else "no schedule (run on demand)"
    )
    print(f"deployment {deployment_id}: {args.flow} of {args.recipe} on work pool {args.pool!r}, {schedule}")
    print(f"start a worker where this checkout is: prefect worker start --pool {args.pool}")
    return 0


def _add_deploy(sub) -> None:
    from flows.deploy import DEFAULT_POOL, ENTRYPOINTS

    p = sub.add_parser(
        "deploy", help="create or update a scheduled deployment of a recipe on a process work pool"
    )
    p.add_argument("recipe", help="a recipe file (e.g. a fork) or a shipped recipe's name")
    p.add_argument("--cron", help='schedule, e.g. "0 2 * * *" (nightly at 02:00); none: run on demand')
    p.add_argument("--timezone", help="IANA time zone of the cron schedule (default UTC)")
    p.add_argument("--name", help="deployment name (default: the recipe's name)")
    p.add_argument(
        "--pool", default=DEFAULT_POOL, help=f"process work pool, created if missing (default {DEFAULT_POOL})"
    )
    p.add_argument(
        "--flow", default="pipeline", choices=sorted(ENTRYPOINTS), help="which flow (default pipeline)"
    )
    for block in ("store", "vllm", "destination"):
        p.add_argument(
            f"--{block}-block", dest=f"{block}_block", metavar="NAME", help=f"name of a saved {block} block"
        )
    p.add_argument("--paused", action="store_true", help="create the schedule paused")
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="train flow of a multi-node recipe: the node this deployment's runs start (0..nnodes-1)",
    )
    p.add_argument("--run-id", default=None, help="train flow: the run id (the same for every node)")
    add_overrides(p)
    p.set_defaults(func=_deploy)


def _add_flows(sub) -> None:
    for name, help_text in (
        ("pipeline", "run every stage of a recipe as a Prefect flow"),
        ("demo", "the `make demo` job: `pipeline` on the default recipe"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("recipe", nargs="?", default="smollm2-135m-dflash-cpu-demo")
        add_overrides(p)
        p.set_defaults(func=_pipeline)
    blocks = sub.add_parser("blocks", help="Prefect blocks of draftflow (servers, stores, destinations)")
    bsub = blocks.add_subparsers(dest="blocks_command", required=True)
    bsub.add_parser("register", help="register the block types with the Prefect server").set_defaults(
        func=_blocks_register
    )
    _add_deploy(sub)


def build_parser() -> argparse.ArgumentParser:
    """The whole `draftflow` command: the core's sub-commands and the Prefect ones (pipeline, demo,
    blocks, deploy). The reference page (scripts/gen_reference.py) is generated from this."""
    return build_core_parser(extra=(_add_flows,))


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
