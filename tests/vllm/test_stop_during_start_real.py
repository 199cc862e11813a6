"""A server stopped while it starts up is gone in seconds, not after the whole grace period.

vLLM's API server (0.32, CPU), sent SIGTERM once its engine core runs but before it answers,
waits on for an engine that has exited: in a probe it outlived 40 s. The launcher's stop (a
start-up that timed out, Ctrl-C) then took the full 20-second grace before its SIGKILL, and so
did the watchdog of a launcher killed during start-up, holding the CPU host lock all along.
"""

from __future__ import annotations

import time

import httpx
import pytest

from draftflow.process_group import group_alive, live_members
from draftflow.vllm.engine_exit import engine_running
from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port

pytestmark = pytest.mark.slow


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_server_stopped_during_start_up_is_gone_in_seconds(
    vllm_servers, vllm_python, smollm2_dir, tmp_path
):
    vllm_servers.stop()  # one vLLM at a time on this host (the launch takes the host lock)
    spec = LaunchSpec(
        python=vllm_python,
        model=str(smollm2_dir),
        port=free_port(),
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        cpu_reserved_cores=0,
        log_path=str(tmp_path / "vllm.log"),
    )
    server = ServerProcess(spec).start()
    try:
        deadline = time.monotonic() + 120
        while not engine_running(live_members(server.pid)):
            assert time.monotonic() < deadline, "vLLM's engine core never started"
            time.sleep(0.1)
        assert not _answers(spec.port)  # still starting
        started = time.monotonic()
        server.stop()  # the default grace: 20 s
        took = time.monotonic() - started
    finally:
        server.stop()
    assert not group_alive(server.pid)
    print(f"stopped during start-up in {took:.1f} s (grace 20 s)")
    assert took < 10, f"{took:.1f} s to stop a server that was starting"
