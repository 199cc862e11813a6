"""The recipe's `vllm.launch` section is the one place launch defaults live: the spec of a server,
the evaluator's server factory and the extraction server all take the typed section."""

from __future__ import annotations

import pytest

from draftflow.evaluation.in_vllm import LaunchServerFactory
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm.launch import CPU_ENGINE_START_ENV, LaunchSpec, build_env


def test_a_spec_takes_device_and_length_from_the_section_and_has_no_defaults_of_its_own():
    section = VLLMLaunchSection()
    spec = LaunchSpec.from_section(section, model="m", port=1234)
    assert (spec.device, spec.max_model_len) == (section.device, section.max_model_len) == ("cuda", 4096)
    assert spec.python.endswith("vllm-venv/bin/python") and "${" not in spec.python
    with pytest.raises(TypeError, match="device"):
        LaunchSpec(python="p", model="m", port=1)  # type: ignore[call-arg]


def test_the_evaluator_factory_is_built_from_the_typed_section():
    cpu = VLLMLaunchSection(
        device="cpu", max_model_len=2048, extra_args=["--enforce-eager"], startup_timeout_s=5
    )
    factory = LaunchServerFactory(cpu)
    assert factory.launch is cpu and factory.dtype == "float32"  # the simulator it is compared with is fp32
    assert LaunchServerFactory(VLLMLaunchSection()).dtype == "auto"
    spec = LaunchSpec.from_section(factory.launch, model="m", port=1, dtype=factory.dtype)
    assert (spec.device, spec.max_model_len, spec.extra_args) == ("cpu", 2048, ["--enforce-eager"])


def test_reserved_cores_reach_a_cpu_server_and_only_when_set():
    reserved = "VLLM_CPU_NUM_OF_RESERVED_CPU"
    every_core = VLLMLaunchSection(device="cpu", cpu_reserved_cores=0)
    assert build_env(LaunchSpec.from_section(every_core, model="m", port=1))[reserved] == "0"
    vllms_choice = LaunchSpec.from_section(VLLMLaunchSection(device="cpu"), model="m", port=1)
    on_gpu = LaunchSpec.from_section(VLLMLaunchSection(cpu_reserved_cores=0), model="m", port=1)
    assert reserved not in build_env(vllms_choice) and reserved not in build_env(on_gpu)
    # the recipe's own env still has the last word
    mine = VLLMLaunchSection(device="cpu", cpu_reserved_cores=0, env={reserved: "1"})
    assert build_env(LaunchSpec.from_section(mine, model="m", port=1))[reserved] == "1"


def test_a_cpu_server_is_asked_to_fork_its_engine_core_unless_the_recipe_says_otherwise():
    asked = CPU_ENGINE_START_ENV
    default = LaunchSpec.from_section(VLLMLaunchSection(device="cpu"), model="m", port=1)
    assert build_env(default)[asked] == "fork"
    low_level = LaunchSpec(python="p", model="m", port=1, device="cpu", max_model_len=16)
    assert build_env(low_level)[asked] == "fork"  # a spec built by hand gets the schema's default
    spawn = VLLMLaunchSection(device="cpu", cpu_engine_start="spawn")
    assert build_env(LaunchSpec.from_section(spawn, model="m", port=1))[asked] == "spawn"
    vllms_choice = VLLMLaunchSection(device="cpu", cpu_engine_start=None)
    assert asked not in build_env(LaunchSpec.from_section(vllms_choice, model="m", port=1))
    assert asked not in build_env(LaunchSpec.from_section(VLLMLaunchSection(), model="m", port=1))
    with pytest.raises(ValueError, match="cpu_engine_start"):
        VLLMLaunchSection(device="cpu", cpu_engine_start="forkserver")
