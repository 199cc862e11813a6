"""bench/cpu_cores.py compares the two settings it names and nothing else: only the every-core
server gets the reservation of 0, only the forked-engine server the fork, only the bfloat16 server
bfloat16; both of a pair get the same model and flags (and dtype, but for the dtype pair), and
ratios pool all repeats."""

from __future__ import annotations

import json

import torch

from draftflow.models import speculators
from draftflow.models.dflash import DFlash
from draftflow.vllm.launch import CPU_ENGINE_START_ENV, build_command, build_env

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def _pair(bench, args, comparison: str):
    return [bench.server_spec(args, setting) for setting in bench.COMPARISONS[comparison].values()]


def test_the_two_settings_differ_only_in_the_core_reservation(bench_module, tmp_path):
    bench = bench_module("cpu_cores")
    args = bench.parse_args(["--model", "/models/m", "--work-dir", str(tmp_path)])
    default, every = _pair(bench, args, "cores")
    assert RESERVED not in build_env(default) and build_env(every)[RESERVED] == "0"
    assert build_env(default)[CPU_ENGINE_START_ENV] == build_env(every)[CPU_ENGINE_START_ENV] == "fork"
    strip = lambda cmd: [a for a in cmd if not a.isdigit()]  # noqa: E731 (the ports differ)
    assert strip(build_command(default)) == strip(build_command(every))
    assert "--no-enable-prefix-caching" in build_command(every)
    drafter = _export_config(tmp_path / "export", speculative_tokens=1)
    served = bench.server_spec(args, {"cpu_reserved_cores": 0}, drafter=drafter)
    # vLLM refuses a --speculative-config drafter without its draft length
    assert served.speculative_config == {"model": drafter, "num_speculative_tokens": 1}
    assert build_env(served)[RESERVED] == "0"


def test_the_engine_start_settings_differ_only_in_how_the_engine_core_starts(bench_module, tmp_path):
    bench = bench_module("cpu_cores")
    args = bench.parse_args(
        ["--compare", "engine-start", "--model", "/models/m", "--work-dir", str(tmp_path)]
    )
    spawned, forked = _pair(bench, args, "engine-start")
    assert (build_env(spawned)[CPU_ENGINE_START_ENV], build_env(forked)[CPU_ENGINE_START_ENV]) == (
        "spawn",
        "fork",
    )
    assert build_env(spawned)[RESERVED] == build_env(forked)[RESERVED] == "0"  # as the CPU recipes
    strip = lambda cmd: [a for a in cmd if not a.isdigit()]  # noqa: E731 (the ports differ)
    assert strip(build_command(spawned)) == strip(build_command(forked))


def test_the_dtype_settings_differ_only_in_the_dtype(bench_module, tmp_path):
    bench = bench_module("cpu_cores")
    args = bench.parse_args(["--compare", "dtype", "--model", "/models/m", "--work-dir", str(tmp_path)])
    fp32, bf16 = _pair(bench, args, "dtype")
    first, second = build_command(fp32), build_command(bf16)
    assert (
        first[first.index("--dtype") + 1] == "float32" and second[second.index("--dtype") + 1] == "bfloat16"
    )
    strip = lambda cmd: [a for a in cmd if not a.isdigit() and "float" not in a]  # noqa: E731
    assert strip(first) == strip(second) and build_env(fp32) == build_env(bf16)
    # the other comparisons compute in --dtype
    cores = bench.parse_args(["--dtype", "bfloat16", "--model", "/models/m", "--work-dir", str(tmp_path)])
    assert {spec.dtype for spec in _pair(bench, cores, "cores")} == {"bfloat16"}


def _export_config(folder, speculative_tokens: int) -> str:
    """The config.json of a DFlash export (no weights: the bench reads only the config)."""
    config = speculators.envelope(
        model_type="dflash",
        architecture=DFlash.architecture,
        speculative_tokens=speculative_tokens,
        verifier_name_or_path="/models/m",
        verifier_architectures=["LlamaForCausalLM"],
        transformer_layer_config={},
        dtype=torch.float32,
        fields={DFlash.aux_layer_ids_key: [2, 15, 27]},
    )
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_ratios_pool_tokens_over_seconds_not_rates(bench_module):
    pooled = bench_module("cpu_cores").pooled
    # 200 tokens in 10 s; the mean of the two rates would be 55.6
    assert pooled("stream", [(100, 1.0), (100, 9.0)]) == 20.0


def test_start_up_pools_to_seconds_per_start(bench_module):
    # the printed table and the JSON line both read seconds, not starts per second
    assert bench_module("cpu_cores").pooled("start", [(1, 20.0), (1, 30.0)]) == 25.0
