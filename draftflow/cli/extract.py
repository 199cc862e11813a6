"""`draftflow extract RECIPE`: make the recipe's data folder complete, with a progress bar."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from draftflow.cli import add_overrides, add_storage_options, storage_options
from draftflow.extraction import ExtractionProgress
from draftflow.process_env import VLLM_API_KEY_ENV, vllm_api_key_from_env

_BAR_WIDTH = 24


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "extract",
        help="extract the recipe's hidden states into its data folder (only missing, failed or corrupt shards)",
        description="Checks (or starts, with vllm.launch) the vLLM server(s), prepares the data if needed, "
        "reconciles the data folder with its manifest and extracts the shards that are not complete. "
        f"The vLLM API key, if the servers need one, is read from ${VLLM_API_KEY_ENV}. Safe to interrupt "
        "and rerun at any point.",
    )
    p.add_argument("recipe")
    add_overrides(p)
    add_storage_options(p)
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="check existing shards by size only instead of re-hashing them (faster on big stores)",
    )
    p.set_defaults(func=cmd_extract)


class ProgressBar:
    """Progress on stderr: a ``rich`` bar on a terminal (samples done/total, rate, ETA, failures;
    :mod:`draftflow.progress`); in a log (not a terminal), one plain line per stage and per
    committed shard."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 0.2):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = interval_s
        self.last_draw = 0.0
        self.open_line = False
        self.progress = None  # draftflow.progress.Progress drawing the rich bar (terminal only)

    def __call__(self, p: ExtractionProgress) -> None:
        if p.event == "stage" and p.stage != "extract":
            self.line(f"{p.stage}: {p.message}")
            return
        if p.event == "stage":
            self.line(f"extract: {p.message}")
        if not self.tty:
            if p.event == "shard":
                self.line(f"{self.render(p)}  {p.message}")
            return
        from draftflow.progress import Progress, RichBar

        if self.progress is None:
            self.progress = Progress(
                "extract",
                p.samples_planned,
                unit="samples",
                sinks=[RichBar(self.stream)],
                interval_s=self.interval_s,
            )
        self.progress.update(done=p.samples_done, failed=p.samples_failed)
        self.last_draw = time.monotonic()

    @staticmethod
    def render(p: ExtractionProgress) -> str:
        filled = _BAR_WIDTH * p.samples_done // p.samples_planned if p.samples_planned else _BAR_WIDTH
        return (
            f"[{'#' * filled}{'-' * (_BAR_WIDTH - filled)}] {p.samples_done}/{p.samples_planned} samples, "
            f"shards {p.shards_done}/{p.shards_planned}, {p.tokens_per_s:,.0f} tokens/s, {p.samples_failed} failed"
        )

    def line(self, text: str) -> None:
        """A line of its own, after ending the bar's line if one is drawn."""
        self.finish()
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.open_line:
            self.stream.write("\n")
            self.open_line = False


def cmd_extract(args: argparse.Namespace) -> int:
    from draftflow.data.regenerate import RegenerationError
    from draftflow.extraction import run_extraction
    from draftflow.plan import NOT_THE_STORE, Plan
    from draftflow.vllm.client import VLLMError
    from draftflow.vllm.launch import ServerStartError

    plan = Plan.load(
        args.recipe,
        args.overrides,
        storage_options=storage_options(args),
        skip_storage=NOT_THE_STORE,
        segment="new",
    )
    bar = ProgressBar()
    bar.line(plan.describe())
    from draftflow.progress import RichBar, reporting

    try:
        with reporting(RichBar()):  # preparation's reply regeneration: a bar of its own
            summary = run_extraction(
                plan,
                storage_options=storage_options(args),
                api_key=vllm_api_key_from_env(),
                progress=bar,
                verify=not args.no_verify,
            )
    except (VLLMError, ServerStartError, RegenerationError) as err:
        bar.finish()
        print(f"error: {err}", file=sys.stderr)
        return 1
    bar.finish()
    print(summary)
    if summary.ok and plan.window is not None:  # a traffic window: its segment is complete
        from draftflow.data.segments import list_segment

        list_segment(plan.store, plan.recipe.name, plan.fingerprint, plan.window, storage_options(args))
    return 0 if summary.ok else 1
