"""A recipe resolved for running: target read, layer ids and fingerprint fixed, paths built.

Every stage (prepare, extract, train, evaluate, publish) starts from a :class:`Plan`
rebuilt from the recipe file and its overrides — small references that pass between
Prefect tasks and torchrun processes alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftflow.data.segments import Window, list_segments, resolve_window
from draftflow.paths import DataLayout
from draftflow.recipe.catalog import resolve
from draftflow.recipe.checks import resolve_context_layer_ids, storage_errors, validate
from draftflow.recipe.fingerprint import fingerprint
from draftflow.recipe.load import RecipeError, expand
from draftflow.recipe.schema import Recipe
from draftflow.remote import options_for
from draftflow.target import TargetInfo

NOT_THE_STORE = ("training.run_dir", "publish.destination")  # skip_storage of store-only work


@dataclass(frozen=True)
class Plan:
    recipe_path: str
    overrides: tuple[str, ...]
    recipe: Recipe
    target: TargetInfo
    target_model: str  # expanded path or hub id, as vLLM and transformers load it
    layer_ids: tuple[int, ...]
    context_layer_ids: tuple[int, ...]
    fingerprint: str
    data: DataLayout
    window: Window | None = None  # the traffic window this run reads (recipes with a traffic source)

    @classmethod
    def load(
        cls,
        recipe: str,
        overrides: list[str] | tuple[str, ...] = (),
        *,
        storage_options: dict | None = None,
        skip_storage: tuple[str, ...] = (),
        data: dict | None = None,
        fixed_fingerprint: str | None = None,
        window: Window | None = None,
        segment: str = "newest",
    ) -> Plan:
        """Validate and resolve. ``storage_options``: the store block's fsspec options (None: the
        environment's); an ``s3://`` store, run folder or destination with no credentials in them
        nor in the environment fails here, before any server starts (``skip_storage``: fields a
        block replaces, e.g. ``publish.destination``). ``data`` and ``fixed_fingerprint``: the
        recipe's content and fingerprint as a run reference froze them (draftflow.run_ref), so a
        stage of a run plans what the run started with, whatever happened to the file since.
        ``window``: the traffic window a run reference froze. None, for a recipe with a traffic
        source: ``segment="new"``, the window of a run starting now (what prepare and extract
        write); ``"newest"``, the newest listed segment's (what train, evaluate and publish read)."""
        path = str(resolve(recipe)) if data is None else recipe
        checked = validate(path, overrides, data)
        if checked.target is None:
            raise RecipeError(
                f"{path}: target.model: config of {checked.recipe.target.model!r} is not readable here; "
                "download the model (or point at a local folder) before running"
            )
        r = checked.recipe
        errors = storage_errors(r, storage_options, skip=skip_storage)
        if errors:
            raise RecipeError("; ".join(f"{path}: {e}" for e in errors))
        layer_ids = tuple(checked.layer_ids)
        store = expand(r.extraction.store)
        if r.data.traffic is not None and window is None:
            window = _window(r, store, segment, storage_options)
        elif r.data.traffic is None:
            window = None
        fp = fixed_fingerprint or fingerprint(r, list(layer_ids), storage_options, window=window)
        return cls(
            recipe_path=path,
            overrides=tuple(overrides),
            recipe=r,
            target=checked.target,
            target_model=expand(r.target.model),
            layer_ids=layer_ids,
            context_layer_ids=tuple(resolve_context_layer_ids(r, checked.target)),
            fingerprint=fp,
            data=DataLayout.for_recipe(store, r.name, fp),
            window=window,
        )

    @property
    def store(self) -> str:
        """The store's URL, expanded (the folder that holds every data folder of the recipe)."""
        return expand(self.recipe.extraction.store)

    def describe(self) -> str:
        r = self.recipe
        return (
            f"recipe {r.name} ({self.recipe_path}); target {r.target.model} "
            f"({self.target.num_layers} layers, hidden {self.target.hidden_size}); "
            f"extract layers {list(self.layer_ids)} as {r.extraction.dtype}; "
            f"drafter {r.drafter.kind}; data folder {self.data.root}"
            + (f"; traffic window {self.window}" if self.window else "")
        )


def _window(recipe: Recipe, store: str, segment: str, storage_options: dict | None) -> Window:
    if segment == "new":
        return resolve_window(recipe.data.traffic, store, recipe.name, storage_options)
    if segment != "newest":
        raise ValueError(f"segment is 'new' or 'newest', not {segment!r}")
    listed = list_segments(store, recipe.name, options_for(store, storage_options))
    if not listed:
        raise RecipeError(
            f"{recipe.name}: no traffic segment is listed in {store} yet (a traffic window becomes one "
            "when its extraction completes): run the extract or pipeline flow first"
        )
    return Window.from_dict(listed[-1]["window"])
