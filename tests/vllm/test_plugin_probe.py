"""draftflow knows which vLLM defects the vLLM virtualenv's draftflow plugin fixes, and names a
multi-layer DFlash on CPU as a known issue only where that fix is not loaded."""

from __future__ import annotations

import os
import socket

import pytest

from draftflow.models.dflash import DFlash
from draftflow.models.eagle3 import Eagle3
from draftflow.vllm.plugin import (
    CPU_ENGINE_START,
    DFLASH_CPU_K_NORM,
    PLUGIN_DIR,
    PLUGIN_NAME,
    installed_fixes,
)


def test_the_bootstrapped_vllm_venv_loads_the_plugin_unless_vllm_plugins_excludes_it(vllm_python):
    assert installed_fixes(vllm_python) == {DFLASH_CPU_K_NORM, CPU_ENGINE_START}
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


def _is_socket(sock: socket.socket) -> bool:
    try:
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        return True
    except OSError:  # ENOTSOCK: the descriptor now points at /dev/null
        return False


class _CpuPlatformAsVLLM032:
    """What vLLM 0.32's CPU platform does to the start method while it checks a config."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        vllm_config.append(cls)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def test_the_plugin_forks_the_engine_core_and_spawns_what_the_engine_core_starts(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    from draftflow_vllm_cpu import engine_start

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.delenv(engine_start.ENV, raising=False)
    platform = type("Platform", (_CpuPlatformAsVLLM032,), {})
    assert engine_start.install(platform) is False  # nothing asked: vLLM's choice stands
    platform.check_and_update_config([])
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"

    monkeypatch.setenv(engine_start.ENV, "fork")
    assert engine_start.install(platform) is True and engine_start.install(platform) is True  # once
    seen: list = []
    platform().check_and_update_config(seen)  # called on the instance, as vLLM does
    assert seen == [platform] and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"

    # The forked child (the engine core) starts its worker by spawn: vLLM pins the worker's
    # OpenMP threads through variables that only a freshly loaded OpenMP reads. And it keeps
    # no listening socket of its parent's (the API server's HTTP port).
    # vLLM binds its HTTP socket before it starts the engine core, and listens on it afterwards.
    http = socket.socket()
    http.bind(("127.0.0.1", 0))
    with http, socket.socket() as client:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, f"{os.environ['VLLM_WORKER_MULTIPROC_METHOD']} {_is_socket(http)}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 64) == b"spawn False"
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
        http.listen()
        client.connect(http.getsockname())  # the parent's socket is its own
        http.accept()[0].close()

    monkeypatch.setenv(engine_start.ENV, "forkserver")
    with pytest.raises(ValueError, match=engine_start.ENV):
        engine_start.install(type("Platform", (_CpuPlatformAsVLLM032,), {}))
