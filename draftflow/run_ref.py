"""The run reference: what one run of a recipe is, frozen once when the run starts.

A flow run resolves its recipe once (:meth:`RunRef.create`) and hands the reference to every
task; the trainer process gets it through its environment. Each stage builds its
:class:`~draftflow.plan.Plan` from the reference (:meth:`RunRef.plan`), not from the recipe file,
so an edit to the file mid-run cannot change what a later stage or a retried task does: a
task retried from the Prefect UI gets the same reference, hence the same plan and fingerprint.

The reference is a task parameter, shown in the UI and stored with task runs, so it holds no
secret: overrides keep their secret values redacted (``recipe.redact``; the values come from the
environment), and a recipe file that itself holds secret values (``vllm.launch.env`` values,
secret ``extra_args``) is referenced by path and digest only — read again where it is needed,
and refused if it changed since the run started.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict

from draftflow.data.segments import Window
from draftflow.plan import Plan
from draftflow.recipe.catalog import resolve
from draftflow.recipe.load import RecipeError, read_yaml
from draftflow.recipe.redact import redact_args, redact_override

RUN_REF_ENV = "DRAFTFLOW_RUN_REF"  # the trainer's copy: argv is readable by every user of the host
_ENV_REFERENCE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")


class RunRef(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    recipe: str  # the recipe file the run started from
    recipe_sha256: str
    recipe_text: str | None  # None when the file holds secret values
    overrides: tuple[str, ...] = ()  # as the user gave them, secret values redacted
    store_block: str | None = None
    vllm_block: str | None = None
    destination_block: str | None = None
    name: str
    fingerprint: str
    data_root: str
    mode: str
    nnodes: int
    # The traffic window (since or None, until; ISO 8601), frozen at the run's start.
    window: tuple[str | None, str] | None = None

    @classmethod
    def create(
        cls,
        recipe: str,
        overrides: list[str] | tuple[str, ...],
        *,
        resolved_overrides: list[str] | tuple[str, ...] | None = None,
        storage_options: dict | None = None,
        skip_storage: tuple[str, ...] = (),
        store_block: str | None = None,
        vllm_block: str | None = None,
        destination_block: str | None = None,
        segment: str = "newest",
    ) -> tuple[RunRef, Plan]:
        """Read and validate the recipe once; the reference and the plan it gives.
        ``resolved_overrides``: ``overrides`` with secret values restored and the blocks' settings
        appended (what the plan applies); default ``overrides``. ``segment``: for a recipe with a
        traffic source, the window this run reads (see :meth:`Plan.load`): a ``new`` one (prepare,
        extract, pipeline) or the ``newest`` listed segment's (train, evaluate, publish)."""
        path = resolve(recipe)
        text = path.read_text()
        data = _parse(text, path)
        applied = list(overrides if resolved_overrides is None else resolved_overrides)
        plan = Plan.load(
            str(path),
            applied,
            storage_options=storage_options,
            skip_storage=skip_storage,
            data=data,
            segment=segment,
        )
        ref = cls(
            recipe=str(path),
            recipe_sha256=_sha256(text),
            recipe_text=None if holds_secret_values(data) else text,
            overrides=tuple(redact_override(o) for o in overrides),
            store_block=store_block,
            vllm_block=vllm_block,
            destination_block=destination_block,
            name=plan.recipe.name,
            fingerprint=plan.fingerprint,
            data_root=plan.data.root,
            mode=plan.recipe.extraction.mode,
            nnodes=plan.recipe.training.nnodes,
            window=tuple(plan.window.as_dict().values()) if plan.window else None,
        )
        return ref, plan

    def recipe_data(self) -> dict:
        """The recipe file's content as the run started with it."""
        path = Path(self.recipe)
        if self.recipe_text is not None:
            return _parse(self.recipe_text, path)
        text = path.read_text() if path.is_file() else ""
        if _sha256(text) != self.recipe_sha256:
            raise RecipeError(
                f"{self.recipe}: the recipe file changed (or went) since this run started; start a new run "
                "(a run whose recipe holds secret values reads the file again instead of keeping its text)"
            )
        return _parse(text, path)

    def plan(
        self,
        resolved_overrides: list[str] | tuple[str, ...] | None = None,
        *,
        storage_options: dict | None = None,
        skip_storage: tuple[str, ...] = (),
    ) -> Plan:
        """The plan of this run, with its fingerprint (the data folder the run started on)."""
        return Plan.load(
            self.recipe,
            list(self.overrides if resolved_overrides is None else resolved_overrides),
            storage_options=storage_options,
            skip_storage=skip_storage,
            data=self.recipe_data(),
            fixed_fingerprint=self.fingerprint,
            window=Window.from_dict(dict(zip(("since", "until"), self.window))) if self.window else None,
        )

    def to_env(self) -> dict[str, str]:
        return {RUN_REF_ENV: self.model_dump_json()}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RunRef | None:
        raw = (os.environ if environ is None else environ).get(RUN_REF_ENV)
        return cls.model_validate_json(raw) if raw else None


def holds_secret_values(data: dict) -> bool:
    """Whether a recipe's content holds what ``recipe.redact`` hides: a literal launch env value (a
    ``${VAR}`` reference is not one) or a secret ``extra_args`` value."""
    launch = ((data.get("vllm") or {}) if isinstance(data.get("vllm"), dict) else {}).get("launch")
    if not isinstance(launch, dict):
        return False
    env = launch.get("env") or {}
    literal = isinstance(env, dict) and any(
        _ENV_REFERENCE.sub("", str(v)).strip() for v in env.values() if v is not None
    )
    args = launch.get("extra_args") or []
    args = [str(a) for a in args] if isinstance(args, list) else []
    return bool(literal or redact_args(args) != args)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _parse(text: str, path: Path) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict):
        read_yaml(path)  # raises the one-line error naming the file and line
        raise RecipeError(f"{path}: not a YAML mapping")
    return data
