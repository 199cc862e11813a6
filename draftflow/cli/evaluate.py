"""`draftflow evaluate CHECKPOINT --recipe RECIPE [--vllm|--no-vllm] [--draft-length K] [--set k=v]`."""

from __future__ import annotations

import argparse
import sys

from draftflow.cli import add_overrides


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate", help="acceptance of an exported drafter: contract check, offline simulator, vLLM"
    )
    p.add_argument("checkpoint", help="the exported speculators folder (config.json + model.safetensors)")
    p.add_argument("--recipe", required=True, help="the recipe it was trained with (eval prompts, settings)")
    p.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure in vLLM (starts servers from vllm.launch); default: evaluation.in_vllm",
    )
    p.add_argument("--out", default=None, help="report folder (default: the run's eval/ beside export/)")
    p.add_argument(
        "--ignore-contract",
        action="store_true",
        help="evaluate even if the checkpoint does not match its provenance (problems still reported)",
    )
    p.add_argument(
        "--draft-length",
        type=int,
        default=None,
        help="serve and simulate K drafted tokens per step instead of the checkpoint's own (DFlash: "
        "1 to block_size - 1; Eagle3: any chain length), as vLLM's num_speculative_tokens would",
    )
    p.add_argument(
        "--champion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a recipe with a `refresh` section: race the drafter its publish.destination's release "
        "pointer names beside this one and gate on it (default); --no-champion: the usual gate only",
    )
    add_overrides(p)
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args) -> int:
    from draftflow.evaluation.contract import ContractError
    from draftflow.evaluation.offline import DraftLengthError, LosslessError
    from draftflow.evaluation.run import (
        AgreementError,
        EvaluationError,
        default_eval_dir,
        evaluate_checkpoint,
    )
    from draftflow.plan import Plan
    from draftflow.process_env import storage_options_from_env
    from draftflow.refresh import find_champion
    from draftflow.releases import ReleaseError

    out = args.out or default_eval_dir(args.checkpoint)
    options = storage_options_from_env()
    try:
        plan = Plan.load(str(args.recipe), args.overrides, storage_options=options)
        champion = find_champion(plan, plan.recipe.publish.destination, options) if args.champion else None
        evaluation = evaluate_checkpoint(
            args.checkpoint,
            plan,
            storage_options=options,
            champion=champion,
            in_vllm=args.vllm,
            out_dir=out,
            strict_contract=not args.ignore_contract,
            speculative_config=(
                {"num_speculative_tokens": args.draft_length} if args.draft_length is not None else None
            ),
        )
    except (
        ContractError,
        AgreementError,
        LosslessError,
        EvaluationError,
        DraftLengthError,
        ReleaseError,
    ) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(evaluation.markdown(), end="")
    print(f"\nreport: {out}")
    return 0 if evaluation.passed_gate else 1
