"""What each stage gives back: small, typed references (paths, counts, τ), never tensors.

The Prefect tasks return these, the flows read their attributes, and the bench scripts parse
the trainer's result line into :class:`TrainResult` as the training task does. Publishing
returns :class:`draftflow.publish.Published`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from draftflow.train import RESULT_PREFIX


@dataclass(frozen=True)
class PrepareResult:
    data_root: str
    reused: bool  # the prepared data was already there
    report: dict = field(default_factory=dict)  # preparation counts (data.dataset.read_report)


@dataclass(frozen=True)
class ExtractResult:
    shards: int
    failed: int


@dataclass(frozen=True)
class TrainResult:
    """The trainer's result line (global rank 0), or what another node knows of the shared run."""

    run_dir: str
    export_dir: str | None  # None: interrupted, --no-export, or not exported yet on another node
    steps: int | None = None
    resumed_from: str | None = None  # the checkpoint this run went on from
    torn_checkpoints: list = field(default_factory=list)
    skipped_samples: int = 0
    train_samples: int = 0
    interrupted: bool = False
    metrics: dict | None = None
    selected: dict | None = None  # the exported step and why (validation τ or last step)
    training_curves: str | None = None
    init_from: str | None = None  # a warm start: the exported drafter it began from
    replayed_samples: int = 0  # samples of earlier traffic segments mixed in (refresh.replay)
    node_rank: int = 0
    result_on_another_node: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> TrainResult:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_output(cls, lines: Iterable[str]) -> TrainResult | None:
        """The result line among the trainer's stdout lines; None when it printed none."""
        for line in lines:
            if line.startswith(RESULT_PREFIX):
                return cls.from_dict(json.loads(line[len(RESULT_PREFIX) :]))
        return None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EvaluateResult:
    report: str  # report.json of the run's evaluation folder
    tau: float
    passed_gate: bool
