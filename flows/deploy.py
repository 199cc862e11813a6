"""Deployments of the draftflow flows on a process work pool, with this folder as their source.

`draftflow deploy RECIPE --cron "0 2 * * *"` creates (or updates: same flow, same name) a
deployment whose runs a `prefect worker start --pool POOL` on a machine with this checkout
picks up. Nothing is built or pushed: no image, no remote storage; the worker runs the flow
from this folder (`flow.from_source` of a local path), so relative paths in recipes resolve
against it, like `prefect.yaml` at the repository root.

Deployment parameters are shown in the UI and the API to anyone who can read the workspace, so
an override that may carry a secret (`recipe.redact`) is stored there as `KEY=**********`; its
value goes to a Prefect Secret block, which the worker resolves into the flow run's environment
($DRAFTFLOW_SECRET_OVERRIDES, a job variable), where the tasks put it back in its place.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from uuid import UUID

from draftflow.recipe import catalog
from draftflow.recipe.load import RecipeError, load_recipe
from draftflow.recipe.redact import SECRET_OVERRIDES_ENV, split_secret_overrides

SOURCE_DIR = Path(__file__).resolve().parents[1]  # the folder that holds flows/, tasks/, recipes/
DEFAULT_POOL = "draftflow-process"
# Flows a schedule can run on their own: each takes recipe, overrides and block names.
ENTRYPOINTS = {
    "pipeline": "flows/pipeline.py:pipeline",
    "prepare": "flows/stages.py:prepare",
    "extract": "flows/stages.py:extract",
    "train": "flows/stages.py:train",
}
BLOCK_PARAMETERS = {
    "pipeline": ("store_block", "vllm_block", "destination_block"),
    "prepare": ("store_block", "vllm_block"),
    "extract": ("store_block", "vllm_block"),
    "train": ("store_block", "vllm_block"),
}


def recipe_parameter(recipe: str) -> str:
    """What the deployment stores: a shipped recipe's name as given, a file as an absolute path.

    A forked recipe is a file next to the user, not in the work pool's working folder: its
    absolute path is what a worker on this machine (or a shared filesystem) can open.
    """
    catalog.resolve(recipe)  # RecipeError when it is neither
    return str(Path(recipe).resolve()) if Path(recipe).is_file() else recipe


def secret_overrides_block(flow: str, deployment: str) -> str:
    """The Secret block that holds the secret overrides of one deployment (block names allow
    lowercase letters, digits and dashes; the digest keeps similar deployment names apart)."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{flow}-{deployment}".lower()).strip("-")[:40]
    digest = hashlib.sha256(f"{flow}/{deployment}".encode()).hexdigest()[:8]
    return f"draftflow-overrides-{slug}-{digest}"


def secret_job_variables(
    flow: str, deployment: str, overrides: list[str] | tuple[str, ...]
) -> tuple[list, dict]:
    """The overrides as the deployment stores them (secret values redacted) and its job variables:
    the worker's environment gets the redacted values from a Secret block saved here (none: {})."""
    from prefect.blocks.system import Secret

    shown, secret_env = split_secret_overrides(overrides)
    if not secret_env:
        return shown, {}
    block = secret_overrides_block(flow, deployment)
    Secret(value=secret_env[SECRET_OVERRIDES_ENV]).save(block, overwrite=True)
    return shown, {"env": {SECRET_OVERRIDES_ENV: "{{ prefect.blocks.secret." + block + " }}"}}


def ensure_process_pool(name: str) -> bool:
    """Create the process work pool if it does not exist; True when created here."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type="process",
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                    description="draftflow flows, run from a checkout of the repository by `prefect worker start`",
                )
            )
            return True
    if pool.type != "process":
        raise RecipeError(
            f"work pool {name!r} is a {pool.type!r} pool: `draftflow deploy` needs a process "
            "pool (the flows run from this folder, no image); pass --pool another name"
        )
    return False


def deploy(
    recipe: str,
    *,
    cron: str | None = None,
    timezone: str | None = None,
    name: str | None = None,
    pool: str = DEFAULT_POOL,
    overrides: list[str] | tuple[str, ...] = (),
    flow: str = "pipeline",
    blocks: dict[str, str] | None = None,
    paused: bool = False,
    node_rank: int | None = None,
    run_id: str | None = None,
) -> UUID:
    """Create or update the deployment; returns its id. The recipe is validated first (schema +
    overrides: the target need not be on this machine, only on the worker's).

    `node_rank` / `run_id` (train flow only): a multi-node recipe gets one train deployment per
    node, each on a pool whose worker runs on that machine; all start with the same run_id."""
    from prefect import flow as prefect_flow
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.schedules import Cron

    from draftflow.train.launch import check_node_rank

    if flow not in ENTRYPOINTS:
        raise RecipeError(f"--flow {flow!r}: choose one of {', '.join(ENTRYPOINTS)}")
    parameter = recipe_parameter(recipe)
    parsed = load_recipe(catalog.resolve(recipe), list(overrides))
    parameters: dict = {"recipe": parameter}
    if (node_rank is not None or run_id is not None) and flow != "train":
        raise RecipeError(f"--node-rank and --run-id belong to the train flow, not {flow}")
    if node_rank is not None:
        check_node_rank(parsed.training, node_rank)
        parameters["node_rank"] = node_rank
    if run_id is not None:
        parameters["run_id"] = run_id
    for key, value in (blocks or {}).items():
        if value:
            if key not in BLOCK_PARAMETERS[flow]:
                raise RecipeError(f"the {flow} flow takes no {key}")
            parameters[key] = value  # block *names*: the secrets stay in the blocks
    ensure_process_pool(pool)
    name = name or parsed.name
    parameters["overrides"], job_variables = secret_job_variables(flow, name, overrides)
    deployable = prefect_flow.from_source(source=str(SOURCE_DIR), entrypoint=ENTRYPOINTS[flow])
    # Traffic windows start where the last run's ended: two runs at once would read the same lines
    # and list their segments over each other, so a run due while one is running waits its turn.
    one_at_a_time = parsed.data.traffic is not None
    return deployable.deploy(
        name=name,
        work_pool_name=pool,
        build=False,
        push=False,
        parameters=parameters,
        job_variables=job_variables,
        schedule=Cron(cron, timezone=timezone or "UTC") if cron else None,
        paused=paused,
        concurrency_limit=(
            ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
            if one_at_a_time
            else None
        ),
        description=f"draftflow {flow} of recipe {parsed.name}",
        tags=["draftflow", f"recipe:{parsed.name}"],
        print_next_steps=False,
        ignore_warnings=True,
    )
