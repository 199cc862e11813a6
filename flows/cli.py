"""The full `draftflow` command: the core commands plus those that run Prefect flows.

The core package's CLI (`draftflow.cli`) knows nothing about Prefect; this module adds the
flow-backed commands on top of it, keeping imports one-way (core <- tasks <- flows).
"""

from __future__ import annotations

import sys

from draftflow.cli import add_overrides, build_parser, run


def _pipeline(args) -> int:
    from flows.pipeline import pipeline

    result = pipeline(recipe=args.recipe, overrides=list(args.overrides))
    print(result.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions)  # the sub-command action
    for name, help_text in (("pipeline", "run every stage of a recipe as a Prefect flow"),
                            ("demo", "the `make demo` job: `pipeline` on the default recipe")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("recipe", nargs="?", default="smollm2-135m-dflash-cpu")
        add_overrides(p)
        p.set_defaults(func=_pipeline)
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
