"""The recipe's `vllm.launch` section is the one place launch defaults live: the spec of a server,
the evaluator's server factory and the extraction server all take the typed section."""

from __future__ import annotations

import pytest

from draftflow.evaluation.in_vllm import LaunchServerFactory
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm.launch import LaunchSpec


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
