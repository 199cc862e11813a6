"""Helpers of the Prefect tests (imported by name): tiny recipes, runs, the UI's retry call, logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import httpx
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
# Shared helpers of other test folders, imported by name as those folders do.
for _folder in ("extraction", "evaluation"):
    if str(REPO / "tests" / _folder) not in sys.path:
        sys.path.append(str(REPO / "tests" / _folder))

from extraction_helpers import recipe_dict  # noqa: E402

# The Prefect 3.9 UI's "Retry" on a failed flow run (ui-v2 flow-run page; the v1 UI posts the
# same state): the run goes back to SCHEDULED/AwaitingRetry and a runner or worker runs it again
# under the same id. Compare prefect.states.AwaitingRetry.
UI_RETRY_STATE = {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def stop_group(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM the process group a test started (the process is its leader), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def write_tiny_recipe(
    path: Path,
    model: Path,
    store: str,
    endpoint: str,
    name: str = "prefect-test",
    staging: str | None = None,
    prefect: dict | None = None,
) -> str:
    """SmolLM2, ~20 chatterbot train samples, 4 per shard, 128 tokens, fp32, no regeneration.
    `prefect`: the recipe's task-runner section (None: the default, Prefect's thread pool)."""
    recipe = recipe_dict(model, store, endpoint, staging, num_samples=24, max_length=128)
    recipe["name"] = name
    if prefect is not None:
        recipe["prefect"] = prefect
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def trigger(deployment: str, parameters: dict | None = None) -> UUID:
    from prefect.deployments import run_deployment

    return run_deployment(deployment, parameters=parameters, timeout=0).id


def wait_final(flow_run_id: UUID, timeout_s: float = 240, after_run_count: int = 0):
    """The flow run once it is final (and has run more than `after_run_count` times)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state and run.state.type.value in FINAL and run.run_count > after_run_count:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} not final after {timeout_s} s: {run.state!r}")
            time.sleep(1)


def retry_from_ui(api_url: str, flow_run_id: UUID) -> dict:
    """Exactly the request the UI's Retry button sends."""
    response = httpx.post(
        f"{api_url}/flow_runs/{flow_run_id}/set_state",
        json={"state": UI_RETRY_STATE, "force": True},
        timeout=30,
    )
    response.raise_for_status()
    return response.json()


def flow_run_logs(flow_run_id: UUID) -> list[str]:
    """Every log line the flow run (and its tasks) sent to the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    lines, offset = [], 0
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=offset
            )
            lines += [log.message for log in page]
            if len(page) < 200:
                return lines
            offset += 200


def shard_table_rows(key: str, flow_run_id: UUID | None = None) -> dict[str, dict]:
    """The newest shard-table artifact `key` (of one flow run if given), as shard id -> row."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    only = ArtifactFilter(
        key=ArtifactFilterKey(any_=[key]),
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]) if flow_run_id else None,
    )
    with get_client(sync_client=True) as client:
        tables = client.read_artifacts(artifact_filter=only, limit=200)
    latest = max(tables, key=lambda a: a.created)
    data = latest.data if isinstance(latest.data, list) else json.loads(latest.data)
    return {row["shard"]: row for row in data}


def task_runs(flow_run_id: UUID) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def write_publish_recipe(path: Path, target: Path) -> str:
    """A recipe whose target is `target` (any layer count: the default layer ids), DFlash block 4."""
    recipe = recipe_dict(target, str(path.parent / "store"), "http://127.0.0.1:9")
    recipe["name"] = "prefect-publish"
    del recipe["extraction"]["layer_ids"]
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def checkpoint_and_report(target: Path, folder: Path, tau: float, min_tau: float = 1.05) -> tuple[str, str]:
    """A real DFlash export for `target` (contract-sound) and an evaluation report with mean acceptance `tau`."""
    from known_drafters import dflash_checkpoint

    from draftflow.evaluation.report import AcceptanceReport, Evaluation
    from draftflow.models.speculators import checkpoint_digest

    checkpoint = dflash_checkpoint(target, folder / "checkpoint")
    drafts = 20
    accepted = round((tau - 1.0) * drafts)
    offline = AcceptanceReport(
        source="offline",
        drafter="dflash",
        draft_length=3,
        num_prompts=4,
        drafts=drafts,
        draft_tokens=3 * drafts,
        accepted_tokens=accepted,
        accepted_per_position=[min(accepted, drafts), max(accepted - drafts, 0), 0],
    )
    evaluation = Evaluation(
        offline=offline,
        vllm=None,
        min_acceptance_length=min_tau,
        agreement_tolerance=0.1,
        checkpoint=str(checkpoint),
        meta={"recipe": "prefect-publish"},
        checkpoint_digest=checkpoint_digest(checkpoint),
    )
    paths = evaluation.write(folder / "eval")
    return str(checkpoint), str(paths["report"])


def train_fixtures():
    """The trainer tests' store builder (SmolLM2 hidden states from transformers, no vLLM)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "train_store_fixtures", REPO / "tests" / "train" / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
