"""The `vllm` section of a recipe: the server(s) to use, and how to start one."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, FiniteFloat, field_validator

from draftflow.recipe.section import MAX_PARALLEL, MAX_SECONDS, MAX_TOKENS, Section


class VLLMLaunchSection(Section):
    """How to start a vLLM server when none answers at the endpoint."""

    python: str = Field(
        "${DRAFTFLOW_HOME}/vllm-venv/bin/python",
        description="Python interpreter of the virtualenv that has vLLM installed.",
    )
    device: Literal["cpu", "cuda"] = "cuda"
    max_model_len: int = Field(4096, ge=16, le=MAX_TOKENS)
    staging_dir: str = Field(
        "/dev/shm/draftflow-hidden-states",
        description="Where vLLM writes hidden-state files; separate from the store.",
    )
    cpu_reserved_cores: int | None = Field(
        None,
        ge=0,
        le=MAX_PARALLEL,
        description="device cpu: cores kept free of vLLM's compute threads (VLLM_CPU_NUM_OF_RESERVED_CPU); "
        "None: vLLM's own choice (one core). 0 lets a small host compute on every core.",
    )
    cpu_engine_start: Literal["fork", "spawn"] | None = Field(
        "fork",
        description="device cpu: how the API server starts vLLM's engine core (draftflow's vLLM plugin); "
        "fork reuses the server's imports, a start ~9 s shorter; the worker always spawns. None: spawn.",
    )
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: FiniteFloat = Field(600.0, gt=0, le=MAX_SECONDS)


class VLLMSection(Section):
    """The vLLM server(s) used for extraction, regeneration and evaluation."""

    endpoints: list[str] = Field(["http://127.0.0.1:8000"], min_length=1)
    launch: VLLMLaunchSection | None = None
    staging_dirs: list[str] = Field(
        default_factory=list,
        description="Folders the servers write hidden-state files to (seen from this host). draftflow "
        "reads and deletes files only inside these and launch.staging_dir; a file a server names "
        "anywhere else fails that sample and is left untouched.",
    )

    @field_validator("endpoints")
    @classmethod
    def _ports_in_range(cls, endpoints: list[str]) -> list[str]:
        for url in endpoints:
            try:
                port = urlsplit(url).port
            except ValueError:  # a port past 65535
                port = -1
            if port is not None and not 1 <= port <= 65535:
                raise ValueError(f"{url!r}: port must be 1..65535")
        return endpoints

    def staging_folders(self) -> list[str]:
        """Every folder a server may name hidden-state files in (unexpanded): the listed ones,
        plus the launch section's staging_dir, or its default when there is no launch section
        (a server started by hand following the docs writes there)."""
        launch_dir = (self.launch or VLLMLaunchSection()).staging_dir
        return list(dict.fromkeys([*self.staging_dirs, launch_dir]))
