"""Train the recipe's drafter. Run by torchrun; knows nothing about Prefect.

    # CPU, one process
    python -m draftflow.train recipes/smollm2-135m-dflash-cpu.yaml
    # CPU, two processes (gloo)
    torchrun --nproc-per-node 2 -m draftflow.train recipes/smollm2-135m-dflash-cpu.yaml
    # one node, 8 GPUs (NCCL, bf16 autocast)
    torchrun --nproc-per-node 8 -m draftflow.train recipes/qwen3-8b-dflash.yaml
    # several nodes: on machine K (node 0 on the training.rdzv_endpoint host), the same run id
    draftflow train recipes/gemma-4-31b-dflash.yaml --node-rank K --run-id JOB
    # (`--print-command` shows the torchrun line it runs: c10d at training.rdzv_endpoint)

Rerunning the same command (same --run-id) resumes from the newest complete checkpoint whose
files match their checksums; a rerun under other training settings is refused (--force-new).
SIGTERM writes a checkpoint, then exits with code 143.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from draftflow.train import EXIT_INTERRUPTED, EXIT_REFUSED, RESULT_PREFIX
from draftflow.train.args import add_trainer_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m draftflow.train", description="Train the recipe's drafter."
    )
    add_trainer_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from draftflow.paths import RunLayout
    from draftflow.recipe.load import RecipeError
    from draftflow.recipe.redact import restore_secret_overrides
    from draftflow.sample_source import MissingSamples
    from draftflow.train import run_state
    from draftflow.train.checkpointing import CheckpointUnreadable
    from draftflow.train.drafter import WarmStartMismatch
    from draftflow.train.runtime import init_runtime, shutdown

    try:  # before the process group: a bad recipe or missing credentials is one line, no traceback
        # Secret overrides come redacted on argv, their values in the environment (train.launch).
        plan = _plan(args.recipe, restore_secret_overrides(args.overrides))
        if args.init_from is not None:
            plan = warm_schedule(plan)
    except RecipeError as err:
        print(f"draftflow.train: error: {err}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    training = plan.recipe.training
    runtime = init_runtime(training.device)
    try:
        layout = RunLayout.for_run(training.run_dir, plan.recipe.name, plan.fingerprint, args.run_id)
        with run_state.claim(layout, runtime, force_new=args.force_new):
            return _train(args, argv, plan, layout, runtime)
    except (run_state.TrainingRefused, CheckpointUnreadable, MissingSamples, WarmStartMismatch) as err:
        print(f"draftflow.train: error: {err}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    finally:
        shutdown(runtime)


def warm_schedule(plan):
    """A warm-started refresh trains for `refresh.epochs` (its own, shorter schedule) when set."""
    refresh = plan.recipe.refresh
    if refresh is None or refresh.epochs is None:
        return plan
    training = plan.recipe.training.model_copy(update={"epochs": refresh.epochs})
    return dataclasses.replace(plan, recipe=plan.recipe.model_copy(update={"training": training}))


def _plan(recipe: str, overrides: list[str]):
    """From the run reference the launcher put in the environment (draftflow.run_ref: what the run
    started with, whatever happened to the file since); without one, from the recipe file."""
    from draftflow.plan import Plan
    from draftflow.recipe.catalog import resolve
    from draftflow.recipe.load import RecipeError
    from draftflow.run_ref import RUN_REF_ENV, RunRef

    ref = RunRef.from_env()
    if ref is None:
        return Plan.load(recipe, overrides)
    if Path(ref.recipe).resolve() != resolve(recipe).resolve():
        raise RecipeError(f"${RUN_REF_ENV} is a run of {ref.recipe}, not of {recipe}")
    return ref.plan(overrides)


def _train(args, argv, plan, layout, runtime) -> int:
    from draftflow.process_env import storage_options_from_env
    from draftflow.train import drafter, loop, run_state
    from draftflow.train.monitor import Monitor
    from draftflow.train.replay import open_training_source

    options = storage_options_from_env()  # the store's (and run folder's) options, never argv
    init_from = args.init_from
    if runtime.is_main:  # builds and caches the draft vocabulary; the others then read it
        setup = drafter.build(plan, storage_options=options, is_main=True, init_from=init_from)
    runtime.barrier()
    if not runtime.is_main:
        setup = drafter.build(plan, storage_options=options, is_main=False, init_from=init_from)
    source = open_training_source(plan)
    run_state.record_skipped(layout, runtime, source.skipped)
    run_state.check_settings_agreed(
        layout, runtime, run_state.run_settings(plan.recipe, runtime.world_size, list(source.skipped))
    )
    monitor, train_items = Monitor.for_plan(plan, setup, source, layout, runtime)
    result = loop.train(
        setup,
        source,
        layout,
        runtime,
        plan.recipe.training,
        max_steps=args.max_steps,
        monitor=monitor,
        train_items=train_items,
    )
    export_dir, selected = None, None
    if runtime.is_main and not result.interrupted and not args.no_export:
        selected = _select(setup, layout, result.steps, monitor)
        export_dir = _export(setup, plan, layout.export_dir, argv)
        _write_selection(export_dir, selected)
    if runtime.is_main:
        summary = {
            "steps": result.steps,
            "resumed_from": result.resumed_from,
            "torn_checkpoints": result.torn_checkpoints,
            "skipped_samples": len(source.skipped),
            "train_samples": len(train_items),
            "interrupted": result.interrupted,
            "run_dir": layout.root,
            "export_dir": export_dir,
            "metrics": result.last_metrics,
            "selected": selected,
            "training_curves": layout.training_curves if monitor.validations else None,
            "init_from": init_from,
            "replayed_samples": len(getattr(source, "replayed", ())),
        }
        print(RESULT_PREFIX + json.dumps(summary), flush=True)
    return EXIT_INTERRUPTED if result.interrupted else 0


def _select(setup, layout, last_step: int, monitor) -> dict:
    """Load the best validation step's weights into the model (if validated); say which step."""
    from draftflow.train.monitor import load_best

    best = load_best(layout, setup.model) if monitor.validations else None
    if best is None:
        selected = {"step": last_step, "reason": "last step (no validation split)", "val_tau": None}
    else:
        selected = {
            "step": best.step,
            "val_tau": best.tau,
            "last_step": last_step,
            "validations": monitor.validations,
            "reason": "best validation τ (teacher-forced, see draftflow/train/validation.py)",
        }
    print(
        f"exporting the weights of step {selected['step']}: {selected['reason']}"
        + (f", validation τ {best.tau:.4f}" if best else ""),
        file=sys.stderr,
        flush=True,
    )
    return selected


def _write_selection(export_url: str, selected: dict) -> None:
    from draftflow.paths import EXPORT_SELECTION, join
    from draftflow.remote import open_url

    with open_url(join(export_url, EXPORT_SELECTION), "w") as f:
        f.write(json.dumps(selected, indent=2) + "\n")


def _export(setup, plan, export_url: str, argv) -> str:
    from draftflow.remote import is_remote, put_folder
    from draftflow.train import drafter

    command = [sys.executable, "-m", "draftflow.train", *(argv if argv is not None else sys.argv[1:])]
    if not is_remote(export_url):
        path = export_url.removeprefix("file://")
        drafter.export(setup, plan, Path(path), command=command)
        return path
    # An object store has no folders to write into: build the export locally, then one PUT per file.
    with tempfile.TemporaryDirectory() as tmp:
        drafter.export(setup, plan, Path(tmp), command=command)
        put_folder(tmp, export_url)
    return export_url


if __name__ == "__main__":
    sys.exit(main())
