"""Task: run training as a torchrun subprocess and stream its metrics into Prefect.

torchrun is a process boundary: the trainer knows nothing about Prefect. This task reads
the trainer's JSON metric lines from stdout, logs them, keeps a progress artifact up to
date (done/total steps, rate, ETA), publishes validation τ, the exported step and the loss /
validation-τ chart as artifacts, and fails with the tail of stderr when torchrun fails.

torchrun never outlives the task: it runs in its own process group, which the task stops
(SIGTERM, so the ranks agree on a stop and checkpoint, then SIGKILL after STOP_GRACE_S) on
every way out: success, failure, or Prefect cancelling the flow run (the runner's SIGTERM
surfaces as an exception in the task). If the task's process is killed outright, torchrun
gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and stops the same way.
"""

from __future__ import annotations

import collections
import os
import shlex
import subprocess
import threading

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)

from draftflow.paths import RunLayout
from draftflow.plan import Plan
from draftflow.process_group import stop_group, terminate_with_parent
from draftflow.progress import Progress
from draftflow.recipe.redact import redact_args
from draftflow.refresh import find_champion
from draftflow.remote import is_remote
from draftflow.results import TrainResult
from draftflow.run_ref import RunRef
from draftflow.train import RESULT_PREFIX
from draftflow.train.launch import torchrun_launch
from draftflow.train.metrics import parse_line
from tasks.infra import artifact_key, blocks_for, plan_for, run_destination, subprocess_env
from tasks.progress import prefect_sinks


def node_launch(
    ref: RunRef, run_id: str, node_rank: int = 0, max_steps: int | None = None
) -> tuple[Plan, list[str], dict[str, str]]:
    """The plan, this node's torchrun command and the settings it gets through the environment
    (secrets via env, never argv: secret overrides are redacted on it; the run reference, so the
    trainer plans what the run started with)."""
    infra = blocks_for(ref)
    plan = plan_for(ref, infra)
    champion = None
    if plan.recipe.refresh is not None and plan.recipe.refresh.warm_start:
        destination = run_destination(ref, plan, infra.storage_options)
        champion = find_champion(plan, destination.url, destination.storage_options) if destination else None
    init_from = str(champion.folder) if champion else None
    cmd, secret_env = torchrun_launch(
        plan, run_id, node_rank=node_rank, max_steps=max_steps, init_from=init_from
    )
    return plan, cmd, {**subprocess_env(infra), **secret_env, **ref.to_env()}


STOP_GRACE_S = 20.0  # within the 30 s a Prefect runner waits after its SIGTERM before SIGKILL


@task(name="train-drafter", tags=["draftflow-gpu-training"])
def train_drafter(ref: RunRef, run_id: str, max_steps: int | None = None, node_rank: int = 0) -> TrainResult:
    """The trainer's result line: steps, run_dir, export_dir, last metrics.

    With training.nnodes > 1 this task starts the node `node_rank` (one task per machine, the
    same run_id on each). Global rank 0 prints the result line on whichever node the
    rendezvous put it; the tasks of the other nodes return the shared run folder and export
    with ``result_on_another_node``."""
    logger = get_run_logger()
    plan, cmd, launch_env = node_launch(ref, run_id, node_rank, max_steps)
    logger.info("training: %s", shlex.join(redact_args(cmd)))
    sinks = prefect_sinks(artifact_key(plan, "training-progress"), f"training {plan.recipe.name}")
    progress = Progress("training", None, unit="steps", sinks=sinks)
    stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
    env = {**os.environ, **launch_env}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,
        preexec_fn=terminate_with_parent,
    )  # noqa: PLW1509 - one prctl call, no locks
    try:
        drain = threading.Thread(target=lambda: stderr_tail.extend(proc.stderr), daemon=True)
        drain.start()
        rows, result = [], None
        for line in proc.stdout:
            line = line.rstrip("\n")
            record = parse_line(line)
            if record is not None:
                rows.append(record)
                logger.info(
                    "step %(step)s epoch %(epoch)s loss %(loss).4f acc %(acc)s tok/s %(tokens_per_s).0f",
                    record,
                )
                if "val_tau" in record:
                    logger.info(
                        "step %(step)s validation τ %(val_tau).4f per position %(val_acc)s "
                        "(best %(best_val_tau).4f at step %(best_step)s)",
                        record,
                    )
                progress.update(done=record["step"], total=record.get("total_steps") or None)
            elif line.startswith(RESULT_PREFIX):
                result = TrainResult.from_output([line])
        code = proc.wait()
        drain.join(timeout=5)
    finally:
        if stop_group(proc, STOP_GRACE_S):
            logger.warning("training stopped: torchrun (process group %s) was ended with the task", proc.pid)
    if code == 0 and result is None and plan.recipe.training.nnodes > 1:
        return _other_node_result(plan, run_id, node_rank)
    if code != 0 or result is None:
        raise RuntimeError(f"torchrun exited with {code}; stderr tail:\n" + "".join(stderr_tail))
    progress.close()
    if result.init_from or result.replayed_samples:
        logger.info(
            "refresh: warm start from %s, %d samples of earlier segments replayed",
            result.init_from or "(none: from scratch)",
            result.replayed_samples,
        )
    _validation_artifacts(plan, rows, result)
    if rows:
        create_table_artifact(
            key=artifact_key(plan, "training-metrics"),
            table=[
                {
                    "step": r["step"],
                    "epoch": r["epoch"],
                    "loss": round(r["loss"], 4),
                    **{f"acc_{i + 1}": a for i, a in enumerate(r["acc"])},
                    "acceptance_length": round(r["acceptance_length"], 3),
                }
                for r in rows
            ],
            description="training loss and per-position accuracy",
        )
    return result


def _other_node_result(plan: Plan, run_id: str, node_rank: int) -> TrainResult:
    """This node's torchrun succeeded without global rank 0. torchrun's exit barrier waits for
    every node, so rank 0's export (if any) is complete in the shared run folder by now."""
    import fsspec

    layout = RunLayout.for_run(plan.recipe.training.run_dir, plan.recipe.name, plan.fingerprint, run_id)
    fs, export = fsspec.core.url_to_fs(layout.export_dir)
    return TrainResult(
        run_dir=layout.root,
        export_dir=layout.export_dir if fs.exists(export) else None,
        node_rank=node_rank,
        result_on_another_node=True,
    )


def _validation_artifacts(plan: Plan, rows: list[dict], result: TrainResult) -> None:
    """Validation τ per validation, the exported step, and the loss / validation-τ chart."""
    validated = [r for r in rows if "val_tau" in r]
    selected = result.selected or {}
    if validated:
        create_table_artifact(
            key=artifact_key(plan, "training-validation"),
            table=[
                {
                    "step": r["step"],
                    "epoch": r["epoch"],
                    "val_tau": round(r["val_tau"], 4),
                    **{f"val_acc_{i + 1}": a for i, a in enumerate(r["val_acc"])},
                    "exported": r["step"] == selected.get("step"),
                }
                for r in validated
            ],
            description="validation acceptance (teacher-forced τ) during training",
        )
    curves = result.training_curves
    lines = [f"# Training of {plan.recipe.name}", ""]
    if selected:
        tau = selected.get("val_tau")
        lines.append(
            f"Exported step {selected['step']} of {result.steps} ({selected.get('reason')}"
            + (f", validation τ {tau:.4f})" if tau is not None else ")")
        )
    lines.append(f"TensorBoard: `tensorboard --logdir {result.run_dir}`")
    if curves and os.path.isfile(curves):
        import base64

        with open(curves, "rb") as f:
            png = base64.b64encode(f.read()).decode()
        lines += ["", f"![loss and validation τ](data:image/png;base64,{png})"]
        create_link_artifact(
            key=artifact_key(plan, "training-curves"),
            link=f"file://{curves}",
            description="loss and validation τ against step (PNG)",
        )
    elif curves and is_remote(curves):  # a run folder on s3://: link the object, no inline image
        lines += ["", f"Training curves: {curves}"]
        create_link_artifact(
            key=artifact_key(plan, "training-curves"),
            link=curves,
            description="loss and validation τ against step (PNG)",
        )
    create_markdown_artifact(
        key=artifact_key(plan, "training-summary"),
        markdown="\n".join(lines) + "\n",
        description="exported step and training curves",
    )
