"""A CPU server's engine core is forked from its API server (``vllm.launch.cpu_engine_start: fork``,
draftflow's vLLM plugin). A forked child inherits the API server's HTTP socket; if the API server
is killed, the engine core and its worker live on until the launcher stops their process group,
and they must not keep the port: a server restarted there would hang on connections nobody
answers."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_a_killed_api_server_frees_its_port_though_its_forked_engine_core_lives_on(vllm_servers, smollm2_dir):
    # Through the session's server pool: one vLLM server at a time on a CPU host (the launcher's
    # host lock makes a second launch wait for the first to stop).
    server = vllm_servers.get(smollm2_dir)
    try:
        assert server.spec.cpu_engine_start == "fork"  # the schema's default reaches a spec built by hand
        assert "the engine core starts by fork, its worker by spawn" in Path(server.spec.log_path).read_text()
        (api,) = _children(server.pid)  # the watchdog's one child
        (engine,) = _children(api)
        os.kill(api, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _listening(server.spec.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(server.spec.port)
        assert Path(f"/proc/{engine}").exists()  # orphaned, not gone: the launcher's stop ends it
    finally:
        vllm_servers.stop()  # the whole process group; the next test gets a fresh server
