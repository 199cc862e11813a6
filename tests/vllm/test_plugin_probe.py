"""draftflow knows which vLLM defects the vLLM virtualenv's draftflow plugin fixes, and names a
multi-layer DFlash on CPU as a known issue only where that fix is not loaded."""

from __future__ import annotations

from draftflow.models.dflash import DFlash
from draftflow.models.eagle3 import Eagle3
from draftflow.vllm.plugin import DFLASH_CPU_K_NORM, PLUGIN_NAME, installed_fixes


def test_the_bootstrapped_vllm_venv_loads_the_plugin_unless_vllm_plugins_excludes_it(vllm_python):
    assert DFLASH_CPU_K_NORM in installed_fixes(vllm_python)
    assert DFLASH_CPU_K_NORM in installed_fixes(vllm_python, {"VLLM_PLUGINS": f"other,{PLUGIN_NAME}"})
    assert installed_fixes(vllm_python, {"VLLM_PLUGINS": "none"}) == frozenset()
    assert installed_fixes("/nonexistent/bin/python") == frozenset()


def _config(layers: int) -> dict:
    return {"transformer_layer_config": {"num_hidden_layers": layers}}


def test_known_issue_only_for_multilayer_dflash_on_cpu_without_the_fix():
    fixed = frozenset({DFLASH_CPU_K_NORM})
    issue = DFlash.known_serving_issue(_config(3), "cpu")
    assert "3-layer DFlash" in issue and "plugins/draftflow_vllm_cpu" in issue
    assert DFlash.known_serving_issue(_config(3), "cpu", fixed) is None
    assert DFlash.known_serving_issue(_config(1), "cpu") is None
    assert DFlash.known_serving_issue(_config(3), "cuda") is None
    assert Eagle3.known_serving_issue(_config(1), "cpu") is None
