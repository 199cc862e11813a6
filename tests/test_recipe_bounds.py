"""Recipe values are finite and bounded, and a URL handed over as an override stays the string it was.

Every float field of the schema refuses `.inf` and `nan` (YAML spells them `.inf`, `.nan`), every
count and size has an upper bound, ports are at most 65535; the error names the field. A store
URL that YAML would read as something else (a comment, a number, a boolean) reaches the recipe
unchanged.
"""

from __future__ import annotations

import copy
import math
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from draftflow.models import registry
from draftflow.recipe import RecipeError, load_recipe
from draftflow.recipe.load import apply_overrides, recipe_from_dict, string_override
from draftflow.recipe.schema import Recipe

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "smollm2-135m-dflash-cpu-demo.yaml"
SEEDS = {"seed"}  # any integer is a seed


def _members(annotation) -> list:
    """The types a field accepts: Optional / Union / Annotated unwrapped, list[X] as X."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _members(arg)]
    if origin is list:
        return [("list", t) for t in _members(typing.get_args(annotation)[0])]
    return [annotation]


def _fields(model: type[BaseModel], prefix: tuple = ()) -> list[tuple[tuple, type]]:
    """(path, type) of every int and float field under `model`; list items get index 0."""
    out = []
    for name, info in model.model_fields.items():
        for member in _members(info.annotation):
            path = (*prefix, name)
            if isinstance(member, tuple):  # list[X]
                member = member[1]
                if isinstance(member, type) and issubclass(member, BaseModel):
                    out += _fields(member, (*path, 0))
                continue
            if isinstance(member, type) and issubclass(member, BaseModel):
                out += _fields(member, path)
            elif member in (int, float):
                out.append((path, member))
    return out


def _cases(kind: type) -> list[tuple[str, tuple]]:
    """(drafter kind, path) of every `kind` field: the drafter's once per kind, from its own section."""
    cases = {("dflash", path) for path, member in _fields(Recipe) if member is kind and path[0] != "drafter"}
    for name, section in registry.sections().items():
        cases |= {(name, ("drafter", *path)) for path, member in _fields(section) if member is kind}
    return sorted(cases)


def _set(data: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(data)
    node = out
    for part in path[:-1]:
        if isinstance(part, int):
            node = node[part]
        else:
            if node.get(part) is None:  # an absent or null section
                node[part] = {}
            node = node[part]
    node[path[-1]] = value
    return out


def _recipe_with(drafter_kind: str, path: tuple, value) -> dict:
    data = yaml.safe_load(DEMO.read_text())
    if drafter_kind != "dflash":
        data["drafter"] = {"kind": drafter_kind}
    if path[:2] == ("data", "sources"):
        data["data"]["sources"] = [{"kind": "self_generated", "self_generated": {}}]
    return _set(data, path, value)


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


FLOAT_CASES = _cases(float)
INT_CASES = [c for c in _cases(int) if c[1][-1] not in SEEDS]


def test_the_walk_finds_the_fields():
    floats = {_dotted(p) for _, p in FLOAT_CASES}
    assert {"training.lr", "extraction.request_timeout_s", "drafter.ttt_decay"} <= floats
    ints = {_dotted(p) for _, p in INT_CASES}
    assert {"training.epochs", "training.pack_length", "extraction.samples_per_shard"} <= ints


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("case", FLOAT_CASES, ids=lambda c: f"{c[0]}:{_dotted(c[1])}")
def test_every_float_field_refuses_non_finite_values(case, value):
    kind, path = case
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(_recipe_with(kind, path, value), "demo.yaml")
    assert f"demo.yaml: {_dotted(path)}:" in str(err.value)


@pytest.mark.parametrize("case", INT_CASES, ids=lambda c: f"{c[0]}:{_dotted(c[1])}")
def test_every_count_and_size_has_an_upper_bound(case):
    kind, path = case
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(_recipe_with(kind, path, 10**18), "demo.yaml")
    assert f"demo.yaml: {_dotted(path)}:" in str(err.value)


@pytest.mark.parametrize("text", [".inf", ".nan", "-.inf", ".Inf", ".NaN"])
def test_yaml_spellings_of_infinity_are_refused_from_the_command_line(text):
    with pytest.raises(RecipeError, match=r"training\.lr:.*finite"):
        load_recipe(DEMO, [f"training.lr={text}"])


@pytest.mark.parametrize(
    "override, field",
    [
        ("training.epochs=1000000", "training.epochs"),
        ("training.pack_length=100000000000", "training.pack_length"),
        ("extraction.samples_per_shard=100000000", "extraction.samples_per_shard"),
        ("vllm.launch.max_model_len=100000000000", "vllm.launch.max_model_len"),
    ],
)
def test_upper_bounds_name_the_field(override, field):
    with pytest.raises(RecipeError, match=rf"{field}: Input should be less than or equal to"):
        load_recipe(DEMO, [override])


MULTINODE = ["training.nnodes=2", "training.run_dir=s3://b/runs"]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (['vllm.endpoints=["http://127.0.0.1:65536"]'], "vllm.endpoints"),
        (['vllm.endpoints=["http://127.0.0.1:8000", "http://h:99999/v1"]'], "vllm.endpoints"),
        (["training.rdzv_endpoint=head:99999", *MULTINODE], "training"),
        (["training.rdzv_endpoint=head:0", *MULTINODE], "training"),
    ],
)
def test_ports_outside_1_to_65535_are_refused(overrides, field):
    with pytest.raises(RecipeError, match=rf"demo.yaml: {field}: .*port .*1\.\.65535"):
        load_recipe(DEMO, overrides)


def test_valid_ports_still_load():
    recipe = load_recipe(
        DEMO,
        [
            'vllm.endpoints=["http://127.0.0.1:65535", "http://[::1]:8000", "http://host"]',
            "training.rdzv_endpoint=head-node:29400",
            *MULTINODE,
        ],
    )
    assert recipe.vllm.endpoints[0].endswith(":65535") and recipe.training.rdzv_endpoint.endswith(":29400")


HOSTILE_URLS = [
    "/data/store #2",  # YAML: a comment
    "s3://bucket/a: b",  # YAML: a mapping
    "no",  # YAML 1.1: a boolean
    "123",  # a number
    "~",  # null
    "@store",  # a reserved indicator: not YAML at all
    "*backup",  # an alias
    "[x]",  # a list
    "s3://bücket/ströe/😀",
    'quote"and\\backslash',
]


@pytest.mark.parametrize("url", HOSTILE_URLS)
def test_a_string_override_keeps_the_exact_string(url):
    data = apply_overrides({"extraction": {}}, [string_override("extraction.store", url)])
    assert data["extraction"]["store"] == url
    assert load_recipe(DEMO, [string_override("extraction.store", url)]).extraction.store == url


@pytest.mark.slow
@pytest.mark.parametrize("url", ["/srv/draftflow store #2", "no"])
def test_a_store_block_url_reaches_the_plan_unchanged(prefect_harness, tmp_path, url):
    """The Prefect tasks hand the store block's URL to the recipe as an override: it must arrive as
    the block holds it, not re-read as YAML (a '#' cut the URL short, `no` became a boolean)."""
    from blocks.infrastructure import HiddenStateStore
    from draftflow.run_ref import RunRef
    from tasks.infra import blocks_for

    name = f"store-url-{abs(hash(url)) % 10**8}"
    HiddenStateStore(url=url).save(name, overwrite=True)
    ref = RunRef(
        recipe=str(DEMO),
        recipe_sha256="",
        recipe_text=None,
        store_block=name,
        name="demo",
        fingerprint="",
        data_root="",
        mode="offline",
        nnodes=1,
    )
    infra = blocks_for(ref, vllm=False)
    assert load_recipe(DEMO, infra.overrides).extraction.store == url
