"""Recipes: every shipped file validates; malformed ones fail with one line naming file and field."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import yaml

from draftflow.cli import main as cli
from draftflow.recipe import RecipeError, fingerprint, load_recipe, validate
from draftflow.recipe.catalog import all_recipe_files, shipped_dir
from draftflow.target import read_target_info

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "smollm2-135m-dflash-cpu.yaml"


def test_every_shipped_recipe_validates():
    files = all_recipe_files(REPO / "recipes")
    assert len(files) >= 4
    names = {f.stem for f in files}
    assert {
        "smollm2-135m-dflash-cpu",
        "qwen3-8b-dflash",
        "llama-3.1-8b-eagle3",
        "gemma-4-31b-dflash",
    } <= names
    for path in files:
        validate(str(path))  # raises on any invalid file
        first = path.read_text().splitlines()[0]
        assert first.startswith("#"), f"{path} must start with a comment saying how to run it"
        assert "draftflow" in path.read_text().split("\nname:")[0], f"{path}: header lacks the run command"


HEADER_LINES = 8  # what it is for, hardware, wall time and result, how to run and fork it


def test_recipe_headers_are_short_and_carry_no_measurement_history():
    """Figures and their history live on the benchmarks page: a header is at most 8 comment lines,
    with no dates and no host names."""
    for path in all_recipe_files(REPO / "recipes"):
        lines = path.read_text().splitlines()
        header = list(itertools.takewhile(lambda line: line.startswith("#"), lines))
        assert len(header) <= HEADER_LINES, f"{path}: {len(header)} header lines (at most {HEADER_LINES})"
        text = "\n".join(header)
        assert not re.search(r"20\d\d-\d\d-\d\d", text), f"{path}: a date in the header"
        assert not re.search(r"\bhosts? [A-C]\b", text), f"{path}: a host name in the header"
        # below the header, a comment says why a value was chosen; the figures behind it live on
        # the benchmarks page (a decimal reading such as "τ 1.364" or "1.3x" does not belong here)
        for number, line in enumerate(lines[len(header) :], len(header) + 1):
            comment = line.partition("#")[2]
            assert not re.search(r"\d\.\d", comment), f"{path}:{number}: a figure in `{comment}`"


@pytest.mark.parametrize(
    "overrides",
    [[], ["prefect.task_runner=dask"], ["prefect.task_runner=dask", "prefect.workers=3"]],
)
def test_a_dumped_recipe_loads_again(tmp_path, overrides):
    """Exports write the whole recipe (every default included) and evaluation/publishing load it back:
    a validator that looks at which fields were given, not their values, broke that."""
    for path in all_recipe_files(REPO / "recipes"):
        recipe = load_recipe(str(path), overrides)
        dumped = tmp_path / f"{path.stem}.yaml"
        dumped.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
        assert load_recipe(str(dumped)) == recipe


def test_recipe_search_is_recursive(tmp_path):
    nested = tmp_path / "team" / "forks"
    nested.mkdir(parents=True)
    (nested / "deep.yaml").write_text(DEMO.read_text())
    (tmp_path / "top.yml").write_text(DEMO.read_text())
    assert {p.name for p in all_recipe_files(tmp_path)} == {"deep.yaml", "top.yml"}


def test_shipped_dir_is_the_repo_recipes_folder():
    assert shipped_dir().resolve() == (REPO / "recipes").resolve()


def test_published_qwen3_example_is_faithful():
    r = load_recipe(REPO / "recipes" / "qwen3-8b-dflash.yaml")
    assert r.drafter.kind == "dflash"
    assert (
        r.drafter.block_size,
        r.drafter.max_anchors,
        r.drafter.draft_vocab_size,
        r.drafter.num_layers,
    ) == (8, 3072, 8192, 5)
    assert r.extraction.layer_ids[:3] == [2, 18, 33]
    assert (r.training.epochs, r.training.lr, r.training.nproc) == (5, 1e-4, 2)


def _write(tmp_path: Path, data: dict | str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _demo() -> dict:
    return yaml.safe_load(DEMO.read_text())


def _set(data: dict, dotted: str, value) -> dict:
    node = data
    *parents, last = dotted.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    node[last] = value
    return data


def _drop(data: dict, dotted: str) -> dict:
    node = data
    *parents, last = dotted.split(".")
    for p in parents:
        node = node[p]
    del node[last]
    return data


MALFORMED = [
    # (id, mutate(data) -> data, overrides, expected field in message, expected words)
    ("unknown-top-key", lambda d: _set(d, "extration", {"dtype": "float32"}), [], "extration", "unknown key"),
    ("unknown-nested-key", lambda d: _set(d, "drafter.blocksize", 8), [], "drafter.blocksize", "unknown key"),
    ("wrong-type", lambda d: _set(d, "training.epochs", "three"), [], "training.epochs", "integer"),
    (
        "reserved-cores-negative",
        lambda d: _set(d, "vllm.launch.cpu_reserved_cores", -1),
        [],
        "vllm.launch.cpu_reserved_cores",
        "greater than or equal to 0",
    ),
    (
        "speed-rounds-zero",
        lambda d: _set(d, "evaluation.speed_rounds", 0),
        [],
        "evaluation.speed_rounds",
        "greater than or equal to 1",
    ),
    (
        "speed-schedule-unknown",
        lambda d: _set(d, "evaluation.speed_schedule", "shuffled"),
        [],
        "evaluation.speed_schedule",
        "'rotated' or 'interleaved'",
    ),
    (
        "interleaved-on-gpu",
        lambda d: _set(_set(d, "evaluation.speed_schedule", "interleaved"), "vllm.launch.device", "cuda"),
        [],
        "evaluation.speed_schedule",
        "CPU launches only",
    ),
    (
        "block-size-below-2",
        lambda d: _set(d, "drafter.block_size", 1),
        [],
        "drafter.block_size",
        "greater than or equal to 2",
    ),
    (
        "layer-out-of-range",
        lambda d: _set(d, "extraction.layer_ids", [2, 15, 31]),
        [],
        "extraction.layer_ids",
        "out of range",
    ),
    (
        "layer-duplicates",
        lambda d: _set(d, "extraction.layer_ids", [2, 15, 15, 30]),
        [],
        "extraction.layer_ids",
        "duplicates",
    ),
    (
        "layer-unsorted",
        lambda d: _set(d, "extraction.layer_ids", [15, 2, 30]),
        [],
        "extraction.layer_ids",
        "sorted",
    ),
    (
        "layer-negative",
        lambda d: _set(d, "extraction.layer_ids", [-1, 2, 30]),
        [],
        "extraction.layer_ids",
        "negative",
    ),
    (
        "vocab-too-large",
        lambda d: _set(d, "drafter.draft_vocab_size", 60000),
        [],
        "drafter.draft_vocab_size",
        "larger than the target vocabulary",
    ),
    ("unknown-drafter", lambda d: _set(d, "drafter.kind", "medusa"), [], "drafter", "dflash"),
    ("missing-target", lambda d: _drop(d, "target"), [], "target", "Field required"),
    (
        "source-without-path",
        lambda d: _set(d, "data.sources", [{"kind": "sharegpt"}]),
        [],
        "data.sources.0",
        "needs `path`",
    ),
    ("no-sources", lambda d: _set(d, "data.sources", []), [], "data.sources", "at least 1"),
    ("bad-dtype", lambda d: _set(d, "extraction.dtype", "fp8"), [], "extraction.dtype", "bfloat16"),
    ("bad-mode", lambda d: _set(d, "extraction.mode", "sometimes"), [], "extraction.mode", "offline"),
    ("negative-lr", lambda d: _set(d, "training.lr", -0.1), [], "training.lr", "greater than 0"),
    (
        "sample-too-long-for-server",
        lambda d: _set(d, "data.max_length", 1024),
        [],
        "data.max_length",
        "max_model_len",
    ),
    ("multinode-without-rendezvous", lambda d: _set(d, "training.nnodes", 2), [], "rdzv_endpoint", "nnodes"),
    (
        "context-not-extracted",
        lambda d: _set(_set(d, "extraction.layer_ids", [2, 15, 30]), "drafter.context_layer_ids", [3]),
        [],
        "drafter.context_layer_ids",
        "subset",
    ),
    ("unsafe-name", lambda d: _set(d, "name", "../evil"), [], "name", "pattern"),
    (
        "mask-token-outside-vocab",
        lambda d: _set(d, "drafter.mask_token_id", 49152),
        [],
        "drafter.mask_token_id",
        "outside the target vocabulary",
    ),
    (
        "eagle3-with-dflash-field",
        lambda d: _set(d, "drafter", {"kind": "eagle3", "block_size": 8}),
        [],
        "drafter.block_size",
        "unknown key",
    ),
    (
        "override-bad-value",
        lambda d: d,
        ["drafter.block_size=1"],
        "drafter.block_size",
        "greater than or equal to 2",
    ),
    ("override-unknown-key", lambda d: d, ["drafter.nope=1"], "drafter.nope", "unknown key"),
    ("override-not-key-value", lambda d: d, ["drafter.block_size"], "drafter.block_size", "KEY=VALUE"),
    (
        "self-generated-unknown-topic",
        lambda d: _set(
            d,
            "data.sources",
            [{"kind": "self_generated", "self_generated": {"topics": ["coding", "cooking"]}}],
        ),
        [],
        "data.sources.0.self_generated.topics.1",
        "'coding'",
    ),
    (
        "self-generated-zero-temperature",
        lambda d: _set(d, "data.sources", [{"kind": "self_generated", "self_generated": {"temperature": 0}}]),
        [],
        "data.sources.0.self_generated.temperature",
        "greater than 0",
    ),
    (
        "self-generated-settings-on-other-kind",
        lambda d: _set(d, "data.sources", [{"kind": "chitchat", "self_generated": {}}]),
        [],
        "data.sources.0",
        "kind: self_generated",
    ),
    (
        "logit-loss-without-last-layer",
        lambda d: _set(_set(d, "extraction.layer_ids", [2, 15, 27]), "training.loss", "target_logits"),
        [],
        "extraction.layer_ids",
        "last layer 30",
    ),
    (
        "dask-address-on-thread-runner",
        lambda d: _set(d, "prefect", {"address": "tcp://127.0.0.1:8786"}),
        [],
        "prefect.address",
        "only to prefect.task_runner: dask",
    ),
    (
        "dask-address-not-a-scheduler-url",
        lambda d: _set(d, "prefect", {"task_runner": "dask", "address": "127.0.0.1:8786"}),
        [],
        "prefect.address",
        "tcp://HOST:PORT",
    ),
    (
        "dask-workers-with-external-cluster",
        lambda d: d,
        ["prefect={task_runner: dask, address: 'tcp://127.0.0.1:8786', workers: 4}"],
        "prefect.workers",
        "local cluster only",
    ),
    (
        "dask-zero-workers",
        lambda d: d,
        ["prefect.workers=0"],
        "prefect.workers",
        "greater than or equal to 1",
    ),
    ("ray-runner", lambda d: d, ["prefect.task_runner=ray"], "prefect.task_runner", "'threads' or 'dask'"),
    (
        "dflash-draft-longer-than-block",
        lambda d: d,
        ["drafter.speculative_tokens=4"],  # the demo's block is 4: at most 3 drafted tokens
        "speculative_tokens",
        "exceeds block_size - 1 = 3",
    ),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_recipe_fails_with_one_line_naming_file_and_field(tmp_path, smollm2_dir, case):
    _, mutate, overrides, field, words = case
    # The demo recipe's target is ${DRAFTFLOW_HOME}/models/SmolLM2-135M-Instruct = smollm2_dir.
    path = _write(tmp_path, mutate(_demo()))
    with pytest.raises(RecipeError) as info:
        validate(str(path), overrides)
    message = str(info.value)
    assert "\n" not in message
    assert field in message, message
    assert words in message, message
    if not overrides or "=" in overrides[0]:
        assert str(path) in message, message


def test_there_are_at_least_15_malformed_cases():
    assert len(MALFORMED) >= 15


@pytest.mark.parametrize(
    "text, words",
    [("target: [unclosed\n", "not valid YAML"), ("- just\n- a list\n", "must be a YAML mapping")],
)
def test_unparseable_files(tmp_path, text, words):
    path = _write(tmp_path, text)
    with pytest.raises(RecipeError, match=words) as info:
        load_recipe(path)
    assert str(path) in str(info.value)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(RecipeError, match="no such recipe file") as info:
        validate(str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in str(info.value)


def test_dflash_draft_length_defaults_to_the_block_and_may_be_shorter(smollm2_dir):
    demo = REPO / "recipes" / "smollm2-135m-dflash-cpu.yaml"
    block = validate(str(demo)).recipe.drafter.block_size
    assert validate(str(demo)).recipe.drafter.speculative_tokens == block - 1
    assert validate(str(demo), ["drafter.block_size=6"]).recipe.drafter.speculative_tokens == 5
    assert validate(str(demo), ["drafter.speculative_tokens=1"]).recipe.drafter.speculative_tokens == 1


def test_overrides_apply_and_parse_yaml_values():
    r = load_recipe(DEMO, ["drafter.block_size=16", "training.lr=5e-4", "extraction.layer_ids=[1, 5, 30]"])
    assert r.drafter.block_size == 16 and r.drafter.speculative_tokens == 15
    assert r.drafter.decay_gamma == 7.0
    assert r.training.lr == 5e-4
    assert r.extraction.layer_ids == [1, 5, 30]


def test_default_layer_ids_follow_speculators_convention(smollm2_dir, tmp_path):
    assert read_target_info(str(smollm2_dir)).default_layer_ids() == [2, 15, 27, 30]
    qwen_like = tmp_path / "qwen"
    qwen_like.mkdir()
    (qwen_like / "config.json").write_text(
        json.dumps({"num_hidden_layers": 36, "hidden_size": 4096, "vocab_size": 151936})
    )
    assert read_target_info(str(qwen_like)).default_layer_ids() == [2, 18, 33, 36]
    gemma_like = tmp_path / "gemma"
    gemma_like.mkdir()
    (gemma_like / "config.json").write_text(
        json.dumps({"text_config": {"num_hidden_layers": 60, "hidden_size": 5376, "vocab_size": 262144}})
    )
    assert read_target_info(str(gemma_like)).default_layer_ids() == [2, 30, 57, 60]


def test_hub_target_reports_skipped_checks_never_passed(capsys):
    result = validate(str(REPO / "recipes" / "qwen3-8b-dflash.yaml"))
    assert result.target is None and len(result.skipped) >= 3
    assert cli(["recipes", "validate", str(REPO / "recipes" / "qwen3-8b-dflash.yaml")]) == 0
    out = capsys.readouterr().out
    assert "SKIPPED, not passed" in out and "passed (layers" not in out


def test_fingerprint_tracks_what_changes_hidden_states(smollm2_dir, tmp_path):
    base = validate(str(DEMO))
    fp = fingerprint(base.recipe, base.layer_ids)

    def fp_with(*overrides):
        v = validate(str(DEMO), list(overrides))
        return fingerprint(v.recipe, v.layer_ids)

    assert fp_with() == fp, "fingerprint must be deterministic"
    assert fp_with("training.lr=1e-2", "training.epochs=9", "drafter.block_size=8") == fp
    for changed in (
        "extraction.layer_ids=[2, 14, 27, 30]",
        "extraction.dtype=bfloat16",
        "data.seed=1",
        "data.num_samples=100",
        "data.max_length=256",
        "target.revision=abc",
    ):
        assert fp_with(changed) != fp, changed
    other = tmp_path / "other-target"
    other.mkdir()
    (other / "config.json").write_text((smollm2_dir / "config.json").read_text())
    assert fp_with(f"target.model={other}") != fp
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    assert fp_with(f"target.chat_template={template}") != fp


def test_cli_ls_cp_validate_show(tmp_path, capsys):
    assert cli(["recipes", "ls"]) == 0
    assert "smollm2-135m-dflash-cpu" in capsys.readouterr().out

    fork = tmp_path / "mine.yaml"
    assert cli(["recipes", "cp", "smollm2-135m-dflash-cpu", str(fork)]) == 0
    assert fork.read_text() == DEMO.read_text()
    assert cli(["recipes", "cp", "smollm2-135m-dflash-cpu", str(fork)]) == 2  # no silent overwrite
    capsys.readouterr()

    assert cli(["recipes", "validate", str(fork)]) == 0
    assert "target checks passed" in capsys.readouterr().out

    assert cli(["recipes", "show", str(fork), "--set", "drafter.block_size=8"]) == 0
    shown = capsys.readouterr().out
    resolved = yaml.safe_load(shown)
    assert resolved["drafter"]["block_size"] == 8
    assert resolved["training"]["schedule"] == "cosine"  # a default, filled in from the schema
    assert "extraction.layer_ids = [2, 15, 27, 30]" in shown

    bad = _write(tmp_path, _set(_demo(), "drafter.block_size", 1), "bad.yaml")
    assert cli(["recipes", "validate", str(fork), str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "drafter.block_size" in err


def test_self_generated_source_needs_a_template_with_a_user_role(tmp_path, smollm2_dir):
    # Renders system and assistant turns only: a user message vanishes from the text.
    template = tmp_path / "no-user.jinja"
    template.write_text(
        "{%- for m in messages %}{%- if m.role != 'user' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    data = _set(_demo(), "data.sources", [{"kind": "self_generated"}])
    data["target"]["chat_template"] = str(template)
    path = _write(tmp_path, data)
    with pytest.raises(RecipeError) as info:
        validate(str(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "target.chat_template" in message and "no user role" in message, message
    # The target's own template has a user role: the same recipe without the override validates.
    del data["target"]["chat_template"]
    validate(str(_write(tmp_path, data, "ok.yaml")))
