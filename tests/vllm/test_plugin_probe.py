"""draftflow knows which vLLM defects the vLLM virtualenv's draftflow plugin fixes, and names a
multi-layer DFlash on CPU as a known issue only where that fix is not loaded."""

from __future__ import annotations

import subprocess
import sys

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


# Run in a fresh interpreter: the plugin registers an at-fork handler, which would otherwise stay
# in the test process for the rest of the session.
_FORK_SCENARIO = r"""
import os, socket, sys
sys.path.insert(0, sys.argv[1])
from draftflow_vllm_cpu import engine_start


class Platform:  # what vLLM 0.32's CPU platform does to the start method while it checks a config
    @classmethod
    def check_and_update_config(cls, vllm_config):
        vllm_config.append(cls)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def is_socket(sock):
    try:
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        return True
    except OSError:  # ENOTSOCK: the descriptor now points at /dev/null
        return False


os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
os.environ.pop(engine_start.ENV, None)
assert engine_start.install(Platform) is False  # nothing asked: vLLM's choice stands
Platform.check_and_update_config([])
assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"

os.environ[engine_start.ENV] = "fork"
assert engine_start.install(Platform) is True and engine_start.install(Platform) is True  # once
seen = []
Platform().check_and_update_config(seen)  # called on the instance, as vLLM does
assert seen == [Platform] and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"

# The forked child (the engine core) starts its worker by spawn, and keeps no server socket of
# its parent's. vLLM binds its HTTP socket before it starts the engine core, listens afterwards.
http = socket.socket()
http.bind(("127.0.0.1", 0))
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, f"{os.environ['VLLM_WORKER_MULTIPROC_METHOD']} {is_socket(http)}".encode())
    os._exit(0)
os.waitpid(pid, 0)
child = os.read(read, 64).decode()
assert child == "spawn False", child
assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
http.listen()
with socket.create_connection(http.getsockname()):  # the parent's socket is its own
    http.accept()[0].close()

os.environ[engine_start.ENV] = "forkserver"
try:
    engine_start.install(type("Other", (Platform,), {}))
    raise SystemExit("an unknown method was accepted")
except ValueError as e:
    assert engine_start.ENV in str(e)
print("ok")
"""


def test_the_plugin_forks_the_engine_core_and_spawns_what_the_engine_core_starts():
    """The engine core spawns its worker because vLLM pins the worker's OpenMP threads through
    variables that only a freshly loaded OpenMP reads (a forked worker decoded ~30% slower)."""
    run = subprocess.run(
        [sys.executable, "-c", _FORK_SCENARIO, str(PLUGIN_DIR)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
