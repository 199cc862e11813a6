"""The recipe's `prefect` section: where the Prefect flows run their extraction shard tasks.

Plain configuration (no Prefect import): the core package validates it with the rest of the recipe.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from draftflow.recipe.section import MAX_PARALLEL, Section

LOCAL_DASK_WORKERS = 2


class PrefectSection(Section):
    """Where the Prefect flows run their extraction shard tasks (the `draftflow extract` command and
    torchrun never read this: they run shards in their own process)."""

    task_runner: Literal["threads", "dask"] = Field(
        "threads",
        description="threads: Prefect's thread pool inside the flow-run process. dask: prefect-dask's "
        "DaskTaskRunner, one shard task at a time per Dask worker process.",
    )
    address: str | None = Field(
        None,
        description="task_runner dask: tcp://HOST:PORT of a running Dask scheduler whose workers have this "
        "checkout importable; None: the flow starts a distributed.LocalCluster of `workers` processes.",
    )
    workers: int | None = Field(
        None,
        ge=1,
        le=MAX_PARALLEL,
        description="task_runner dask without an address: worker processes of the local cluster; "
        f"None: {LOCAL_DASK_WORKERS}.",
    )

    @field_validator("address")
    @classmethod
    def _scheduler_url(cls, value: str | None) -> str | None:
        match = re.fullmatch(r"(tcp|tls)://[^\s/:]+:(\d{1,5})", value) if value is not None else None
        if value is not None and (match is None or not 1 <= int(match.group(2)) <= 65535):
            raise ValueError(
                f"{value!r} is not a scheduler address of the form tcp://HOST:PORT (port 1..65535)"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PrefectSection:
        # Contradictions are errors, not silently ignored settings.
        # By value, not by which fields were given: an exported recipe.yaml holds every field.
        if self.task_runner != "dask" and (self.address is not None or self.workers is not None):
            raise ValueError("prefect.address and prefect.workers apply only to prefect.task_runner: dask")
        if self.address is not None and self.workers is not None:
            raise ValueError(
                "prefect.workers sizes the local cluster only; the cluster at prefect.address has its own"
            )
        return self

    @property
    def local_workers(self) -> int:
        return self.workers or LOCAL_DASK_WORKERS
