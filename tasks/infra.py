"""Blocks → plain settings for the core. Tasks receive block *names*, never secrets.

A task parameter is hashed, stored and shown in the UI; a secret must never be one. Each
task loads the blocks it needs by name and hands plain values to the core.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from blocks.infrastructure import CheckpointDestination, HiddenStateStore, VLLMServer
from draftflow.plan import Plan
from draftflow.process_env import STORAGE_OPTIONS_ENV, VLLM_API_KEY_ENV, storage_options_from_env
from draftflow.publish import Destination
from draftflow.recipe.load import string_override
from draftflow.recipe.redact import restore_secret_overrides
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.run_ref import RunRef


@dataclass
class Infra:
    overrides: list[str] = field(repr=False)  # secret overrides restored: never shown
    storage_options: dict = field(default_factory=dict, repr=False)
    endpoints: list[str] | None = None
    api_key: str | None = field(default=None, repr=False)
    launch: VLLMLaunchSection | None = None
    launch_from_block: bool = False


def start_run(
    recipe: str,
    overrides: list[str],
    store_block: str | None = None,
    vllm_block: str | None = None,
    destination_block: str | None = None,
    segment: str = "newest",
) -> tuple[RunRef, Plan]:
    """The flow run's one resolution of its recipe: the run reference every task gets, and its plan
    (remote folders checked against the store block's credentials, else the environment's)."""
    infra = _settings(overrides, store_block, None)
    return RunRef.create(
        recipe,
        overrides,
        resolved_overrides=infra.overrides,
        storage_options=infra.storage_options or None,
        skip_storage=_skipped(destination_block),
        store_block=store_block,
        vllm_block=vllm_block,
        destination_block=destination_block,
        segment=segment,
    )


def blocks_for(ref: RunRef, *, vllm: bool = True) -> Infra:
    """The settings the run's blocks hold now (secrets included), loaded inside the task that needs
    them; ``vllm``: whether that task talks to vLLM (the vLLM block is read only then)."""
    return _settings(list(ref.overrides), ref.store_block, ref.vllm_block if vllm else None)


def plan_for(ref: RunRef, infra: Infra, *, skip_storage: tuple[str, ...] = ()) -> Plan:
    """The run's plan under the blocks' settings; built once per process for the same inputs (every
    shard task of a flow run asks for the same one)."""
    skip = tuple(sorted(set(skip_storage) | set(_skipped(ref.destination_block))))
    options = json.dumps(infra.storage_options or None, sort_keys=True)
    return _plan(ref, tuple(infra.overrides), options, skip)


@functools.lru_cache(maxsize=16)
def _plan(ref: RunRef, overrides: tuple[str, ...], options: str, skip: tuple[str, ...]) -> Plan:
    return ref.plan(overrides, storage_options=json.loads(options), skip_storage=skip)


def _skipped(destination_block: str | None) -> tuple[str, ...]:
    return ("publish.destination",) if destination_block else ()  # the block replaces it


def _settings(overrides: list[str], store_block: str | None, vllm_block: str | None) -> Infra:
    # Parameters hold secret overrides redacted; their values come from the environment (recipe.redact).
    infra = Infra(overrides=restore_secret_overrides(overrides))
    if store_block:
        url, options = HiddenStateStore.load(store_block).settings()
        infra.overrides.append(string_override("extraction.store", url))  # a URL, never re-read as YAML
        infra.storage_options = options
    else:  # as every core command: $DRAFTFLOW_STORAGE_OPTIONS (a run without blocks, `draftflow pipeline`)
        infra.storage_options = storage_options_from_env()
    if vllm_block:
        block = VLLMServer.load(vllm_block)
        settings = block.settings()
        infra.endpoints = list(settings.endpoints)
        infra.api_key = block.api_key_value()
        infra.launch = settings.launch
        infra.launch_from_block = True
        # Through the recipe too: the trainer (torchrun, hybrid / online modes) reads its endpoints
        # from the recipe and would otherwise ask the recipe's servers, not the block's.
        infra.overrides.append(f"vllm.endpoints={json.dumps(infra.endpoints)}")
        if settings.launch is not None:
            # The shard tasks plan from the recipe: they must accept the block's staging folder too.
            infra.overrides.append(f"vllm.staging_dirs={json.dumps([settings.launch.staging_dir])}")
    return infra


def subprocess_env(infra: Infra) -> dict[str, str]:
    """Settings for a subprocess (torchrun) through the environment, not its command line."""

    env = {}
    if infra.storage_options:
        env[STORAGE_OPTIONS_ENV] = json.dumps(infra.storage_options)
    if infra.api_key:
        env[VLLM_API_KEY_ENV] = infra.api_key
    return env


def run_destination(ref: RunRef, plan: Plan, storage_options: dict | None) -> Destination | None:
    """Where the run publishes: its destination block's, else the recipe's (the store's options)."""
    if ref.destination_block:
        return CheckpointDestination.load(ref.destination_block).destination()
    url = plan.recipe.publish.destination
    return Destination.parse(url, storage_options=storage_options) if url else None


def artifact_key(ref: RunRef | Plan, what: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    name = ref.name if isinstance(ref, RunRef) else ref.recipe.name
    return f"{name}-{what}".lower().replace(".", "-").replace("_", "-")
