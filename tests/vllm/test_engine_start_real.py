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

from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_killed_api_server_frees_its_port_though_its_forked_engine_core_lives_on(
    vllm_python, smollm2_dir, tmp_path
):
    log = tmp_path / "vllm.log"
    spec = LaunchSpec(
        python=vllm_python,
        model=str(smollm2_dir),
        port=free_port(),
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        cpu_reserved_cores=0,
        log_path=str(log),
    )
    assert spec.cpu_engine_start == "fork"  # the schema's default reaches a spec built by hand
    with ServerProcess(spec).start() as server:
        server.wait_healthy(300)
        assert "the engine core starts by fork, its worker by spawn" in log.read_text()
        (api,) = _children(server.pid)  # the watchdog's one child
        (engine,) = _children(api)
        os.kill(api, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _listening(spec.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(spec.port)
        assert Path(f"/proc/{engine}").exists()  # orphaned, not gone: the launcher's stop ends it
