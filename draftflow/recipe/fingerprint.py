"""The recipe fingerprint: a hash of everything that changes the extracted hidden states.

It names the recipe's data folder, so editing any of these inputs (target, revision,
tokenizer or chat template, layer ids, dtype, data selection and its sources' content, how
samples are cut into shards) points at a fresh folder instead of silently reusing stale hidden
states. Training hyper-parameters are left out: a new learning rate reuses the same data.

A local source counts by its files' digests; a source on an object store by its listing (keys,
sizes, ETags), read with the store's storage options, so an edited ``s3://`` object names a new
folder too.

``extraction.samples_per_shard`` joined the inputs after data folders had been named without
it (shard k holds positions [k*S, (k+1)*S) of the samples, so two values in one folder
supersede each other's shards and lose samples). A folder named the old way keeps its name
while its shards are cut with the recipe's value (:func:`fingerprint`): no re-extraction
after an upgrade, and any other value gets a folder of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime
from pathlib import Path

from draftflow.recipe.load import RecipeError, expand
from draftflow.recipe.schema import Recipe
from draftflow.remote import is_remote, options_for, url_to_fs

log = logging.getLogger(__name__)

# Bump when the stored sample format or its preparation changes meaning.
DATA_FORMAT_VERSION = 1

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")
_LAYOUT = "samples_per_shard"  # the input that folders named before it lack
# What an object store's listing says about an object's content, most specific first.
_CONTENT_TAGS = ("ETag", "etag", "md5Hash", "crc32c", "LastModified", "last_modified", "updated", "mtime")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _local_identity(path_str: str) -> dict | None:
    """Content of a local path: file digest, or for a folder its small files' digests and weight sizes."""
    path = Path(expand(path_str))
    if path.is_file():
        return {"sha256": _file_digest(path)}
    if not path.is_dir():
        return None
    out: dict[str, str | int] = {}
    for child in sorted(path.iterdir()):
        if child.name in _TOKENIZER_FILES or child.suffix == ".json" and child.stat().st_size < 1 << 20:
            out[child.name] = _file_digest(child)
        elif child.is_file():
            out[child.name] = child.stat().st_size
    return out


def _content_tag(info: dict) -> str:
    for key in _CONTENT_TAGS:
        value = info.get(key)
        if value:
            return value.isoformat() if isinstance(value, datetime) else str(value)
    return ""


def _remote_identity(url: str, storage_options: dict | None) -> dict | None:
    """Listing of a remote file or folder: key under ``url`` -> [size, ETag (else modification time)]."""
    fs, root = url_to_fs(url, storage_options)
    root = root.rstrip("/")
    fs.invalidate_cache(root)  # an object edited since this process last listed it must show
    try:
        info = fs.info(root)
    except FileNotFoundError:
        return None  # as a missing local path: reading it fails later, naming it
    found = fs.find(root, detail=True) if info.get("type") == "directory" else {root: info}
    return {
        path[len(root) :].lstrip("/"): [entry.get("size"), _content_tag(entry)]
        for path, entry in found.items()
    }


def _source_identity(index: int, path: str, storage_options: dict | None) -> dict | None:
    url = expand(path)
    if not is_remote(url):
        return _local_identity(path)
    try:
        return _remote_identity(url, storage_options)
    except Exception as err:  # credentials, endpoint, permissions: whatever the backend raises
        raise RecipeError(
            f"data.sources[{index}].path: cannot list {url} to fingerprint it "
            f"({type(err).__name__}: {err}); check the store's storage options or the source's URL"
        ) from err


def fingerprint_inputs(
    recipe: Recipe, layer_ids: list[int], storage_options: dict | None = None, *, window=None
) -> dict:
    """What the fingerprint hashes. ``storage_options``: the store's fsspec options, for sources on
    an object store (None: ``$DRAFTFLOW_STORAGE_OPTIONS``). ``window``: the traffic window of a
    recipe with a traffic source (draftflow.data.segments.Window): each window is a segment of its
    own. Its log files count by the window, not by their content: lines of a past window do not
    change, while a log being appended to would otherwise rename the segment at every look."""
    # generation_dtype only when set: unset, generation computes in the extraction dtype's
    # server dtype (below), and data folders prepared before the field existed keep their name.
    unset = {"generation_dtype"} if recipe.data.generation_dtype is None else set()
    data = recipe.data.model_dump(exclude={"regenerate_concurrency", *unset})
    for index, (source, raw) in enumerate(zip(data["sources"], recipe.data.sources)):
        if raw.path:
            source["content"] = _source_identity(index, raw.path, storage_options)
    template = recipe.target.chat_template
    windowed = {"window": window.as_dict()} if window is not None else {}
    return {
        **windowed,
        "format": DATA_FORMAT_VERSION,
        "target": {
            "model": recipe.target.model,
            "revision": recipe.target.revision,
            "content": _local_identity(recipe.target.model),
        },
        "chat_template": (_local_identity(template) or template) if template else None,
        "layer_ids": list(layer_ids),
        "dtype": recipe.extraction.dtype,
        "data": data,
        _LAYOUT: recipe.extraction.samples_per_shard,
    }


def _digest(inputs: dict) -> str:
    blob = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fingerprint(
    recipe: Recipe, layer_ids: list[int], storage_options: dict | None = None, *, window=None
) -> str:
    """The data folder's name for ``recipe``: the digest of :func:`fingerprint_inputs`, or the name
    the folder got before samples_per_shard was an input, while that folder is in the store with
    shards cut exactly as the recipe cuts them and the new name holds no prepared data."""
    inputs = fingerprint_inputs(recipe, layer_ids, storage_options, window=window)
    current = _digest(inputs)
    if window is not None:
        return current  # segments were always named with samples_per_shard
    legacy = _digest({key: value for key, value in inputs.items() if key != _LAYOUT})
    store = expand(recipe.extraction.store)
    options = options_for(store, storage_options)
    try:
        if _is_prepared(store, recipe.name, current, options):
            return current
        if _holds_shards_cut_with(store, recipe.name, legacy, recipe.extraction.samples_per_shard, options):
            return legacy
    except Exception as err:  # credentials, endpoint, permissions: whatever the backend raises
        # The new name is always safe: at worst an old folder's shards are extracted again.
        log.warning(
            "cannot look for a data folder named before samples_per_shard was fingerprinted in %s "
            "(%s: %s): using the new name %s",
            store,
            type(err).__name__,
            err,
            current,
        )
    return current


def _is_prepared(store: str, name: str, fp: str, options: dict) -> bool:
    from draftflow.data.dataset import is_prepared
    from draftflow.paths import DataLayout

    return is_prepared(DataLayout.for_recipe(store, name, fp), options)


_fitting_folders: set[tuple[str, int, str]] = set()  # (root, samples_per_shard, options): known to fit


def _holds_shards_cut_with(store: str, name: str, fp: str, per_shard: int, options: dict) -> bool:
    """Whether the data folder ``fp`` is prepared and every shard its manifest lists holds exactly
    the samples at its positions for ``per_shard`` samples a shard (at least one shard listed)."""
    import pyarrow.parquet as pq

    from draftflow.data.dataset import TRAIN
    from draftflow.paths import DataLayout
    from draftflow.store import Store, read_manifest
    from draftflow.store.reconcile import cut_with

    layout = DataLayout.for_recipe(store, name, fp)
    key = (layout.root, per_shard, json.dumps(options, sort_keys=True, default=str))
    if key in _fitting_folders:  # a folder that fits keeps fitting: only this value writes shards there
        return True
    if not _is_prepared(store, name, fp, options):
        return False
    manifest = read_manifest(Store(layout, dict(options)))
    if len(manifest) == 0:
        return False
    # Only the train split's ids, without the whole-file checksum the loaders run: this names a
    # folder, it does not read its samples (which are checked when they are).
    fs, path = url_to_fs(layout.samples, options)
    train = pq.read_table(path, filesystem=fs, columns=["sample_id"], filters=[("split", "=", TRAIN)])
    if not cut_with(manifest, train["sample_id"].to_pylist(), per_shard):
        return False
    _fitting_folders.add(key)
    return True
