"""Checks of a recipe against its target model's config, and the resolved layer ids."""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass, field

from draftflow.recipe.load import RecipeError, apply_overrides, expand, load_recipe, recipe_from_dict
from draftflow.recipe.schema import Recipe
from draftflow.target import TargetInfo, read_target_info

TARGET_CHECKS = (
    "extraction.layer_ids within the target's layers",
    "drafter.context_layer_ids within the target's layers",
    "drafter.draft_vocab_size within the target's vocabulary",
    "drafter.mask_token_id within the target's vocabulary",
)


@dataclass
class Validated:
    """A recipe that passed every check that could run, and the list of those that could not."""

    recipe: Recipe
    target: TargetInfo | None
    skipped: list[str] = field(default_factory=list)

    @property
    def layer_ids(self) -> list[int] | None:
        return resolve_layer_ids(self.recipe, self.target)


def resolve_layer_ids(recipe: Recipe, target: TargetInfo | None) -> list[int] | None:
    if recipe.extraction.layer_ids is not None:
        return list(recipe.extraction.layer_ids)
    return target.default_layer_ids() if target else None


def resolve_context_layer_ids(recipe: Recipe, target: TargetInfo | None) -> list[int] | None:
    """Layers the drafter reads: explicit, or every extracted layer except the final one L."""
    if recipe.drafter.context_layer_ids is not None:
        return list(recipe.drafter.context_layer_ids)
    ids = resolve_layer_ids(recipe, target)
    if ids is None:
        return None
    last = target.num_layers if target else None
    rest = [i for i in ids if i != last]
    return rest or ids


def target_errors(recipe: Recipe, target: TargetInfo) -> list[str]:
    errors = []
    n = target.num_layers
    for name, ids in (
        ("extraction.layer_ids", recipe.extraction.layer_ids),
        ("drafter.context_layer_ids", recipe.drafter.context_layer_ids),
    ):
        bad = [i for i in ids or () if not 0 <= i <= n]
        if bad:
            errors.append(f"{name}: {bad} out of range for a {n}-layer target (valid 0..{n})")
    vocab = recipe.drafter.draft_vocab_size
    if vocab is not None and vocab > target.vocab_size:
        errors.append(
            f"drafter.draft_vocab_size: {vocab} is larger than the target vocabulary ({target.vocab_size})"
        )
    mask = getattr(recipe.drafter, "mask_token_id", None)
    if mask is not None and mask >= target.vocab_size:
        errors.append(f"drafter.mask_token_id: {mask} is outside the target vocabulary ({target.vocab_size})")
    if recipe.training.loss == "target_logits" and n not in (resolve_layer_ids(recipe, target) or ()):
        errors.append(f"extraction.layer_ids: training.loss=target_logits needs the last layer {n}")
    return errors


def validate(path: str, overrides: list[str] | tuple[str, ...] = (), data: dict | None = None) -> Validated:
    """Schema checks, then target checks where the target's config is readable here. ``data``: the
    recipe file's content as read earlier (a run reference), instead of reading ``path`` now."""
    if data is None:
        recipe = load_recipe(path, overrides)
    else:
        recipe = recipe_from_dict(apply_overrides(data, overrides), path)
    errors = redaction_errors(recipe)
    if errors:
        raise RecipeError("; ".join(f"{path}: {e}" for e in errors))
    target = read_target_info(expand(recipe.target.model), recipe.target.revision)
    if target is None:
        return Validated(recipe, None, skipped=list(TARGET_CHECKS))
    errors = target_errors(recipe, target) + template_errors(recipe)
    if errors:
        raise RecipeError("; ".join(f"{path}: {e}" for e in errors))
    return Validated(recipe, target)


def redaction_errors(recipe: Recipe) -> list[str]:
    """A traffic source's `redact_with` must name a function importable here (before any server starts)."""
    from draftflow.data.redaction import load_callable  # the data package imports the recipe package

    errors = []
    for i, source in enumerate(recipe.data.sources):
        if source.traffic is not None and source.traffic.redact_with:
            try:
                load_callable(source.traffic.redact_with)
            except ValueError as err:
                errors.append(f"data.sources[{i}].traffic.redact_with: {err}")
    return errors


def template_errors(recipe: Recipe) -> list[str]:
    """A self-generated source needs a chat template that renders user turns."""
    generated = [i for i, s in enumerate(recipe.data.sources) if s.kind == "self_generated"]
    if not generated:
        return []
    from draftflow.data.chat import load_chat_encoder  # the data package imports the recipe package
    from draftflow.data.self_generated import NoUserRole, check_user_role

    try:
        encoder = load_chat_encoder(recipe.target)
    except ValueError as err:  # no template at all
        return [f"target.chat_template: {err} (data.sources[{generated[0]}] is self_generated)"]
    try:
        check_user_role(encoder)
    except NoUserRole as err:
        field = "target.chat_template" if recipe.target.chat_template else "target.model (its chat template)"
        return [f"{field}: {err}; data.sources[{generated[0]}] (self_generated) needs one"]
    return []


def storage_errors(
    recipe: Recipe, storage_options: dict | None = None, *, skip: tuple[str, ...] = ()
) -> list[str]:
    """Remote folders of the recipe that cannot be written with the credentials available here.

    ``storage_options``: the store block's (None: ``$DRAFTFLOW_STORAGE_OPTIONS``); the run folder and
    an fsspec destination use the same ones. ``skip``: fields another block provides (a destination
    block replaces ``publish.destination``). Fields failing for the same reason share one message.
    """
    from draftflow.remote import missing_credentials  # fsspec / botocore: only when a plan is built

    urls = {"extraction.store": recipe.extraction.store, "training.run_dir": recipe.training.run_dir}
    destination = recipe.publish.destination
    if destination and not destination.startswith("hf://"):
        urls["publish.destination"] = destination
    by_reason: dict[str, list[str]] = {}
    for name, url in urls.items():
        if name in skip:
            continue
        reason = missing_credentials(expand(url), storage_options)
        if reason:
            by_reason.setdefault(reason, []).append(f"{name} ({url})")
    return [f"{', '.join(fields)}: {reason}" for reason, fields in by_reason.items()]


def scheduler_errors(recipe: Recipe, timeout_s: float = 5.0) -> list[str]:
    """`prefect.task_runner: dask` without the dask extra installed, or the Dask scheduler at
    ``prefect.address`` does not accept a connection from here.

    Run by the flows that map shard tasks, before any vLLM server starts: without it a dead
    address surfaces only after the servers are up, as a connection timeout deep in the task runner.
    A TCP connect is enough to tell "nothing there" (no Dask import in the core).
    """
    if recipe.prefect.task_runner != "dask":
        return []
    missing = [name for name in ("prefect_dask", "distributed") if importlib.util.find_spec(name) is None]
    if missing:
        return [
            f"prefect.task_runner: dask needs the dask extra ({', '.join(missing)} not installed): "
            "pip install 'draftflow[dask]', or use task_runner: threads"
        ]
    address = recipe.prefect.address
    if address is None:
        return []
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        if isinstance(err, TimeoutError):
            reason = f"no answer within {timeout_s:.0f} s"
        else:
            reason = (err.strerror or type(err).__name__).lower()
        return [
            f"prefect.address: no Dask scheduler answers at {address} ({reason}); "
            "start it (`dask scheduler`), or remove prefect.address to start a local cluster"
        ]
    return []
