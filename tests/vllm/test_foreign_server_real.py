"""A foreign server on the launch port (answers /health 200 and /v1/models with another model) is
never taken for the vLLM draftflow launched: the launch fails clearly and no extraction request
ever reaches the foreign server.

The foreign server is a small HTTP server on loopback in this process; the launched one is the
real vLLM (CPU), which cannot bind the taken port.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm import lifecycle
from draftflow.vllm.launch import CPU_HOST_LOCK, ServerStartError, free_port
from draftflow.vllm.server import WrongModel, ensure_running

pytestmark = pytest.mark.slow

LAYER_IDS = [2, 15, 27, 30]


class ForeignServer:
    """/health 200, /v1/models "someone-elses-model", every request recorded."""

    def __init__(self, port: int):
        requests = self.requests = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body: dict) -> None:
                blob = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(blob)))
                self.end_headers()
                self.wfile.write(blob)

            def do_GET(self):
                requests.append(("GET", self.path))
                if self.path == "/v1/models":
                    self._answer({"data": [{"id": "someone-elses-model", "root": "someone-elses-model"}]})
                else:
                    self._answer({})

            def do_POST(self):
                requests.append(("POST", self.path))
                self._answer({"choices": [{"text": "x"}]})

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def launch(vllm_servers, vllm_python: str, tmp_path: Path, monkeypatch) -> VLLMLaunchSection:
    vllm_servers.stop()  # it holds the CPU host lock this test takes
    monkeypatch.setenv("DRAFTFLOW_HOME", str(tmp_path / "home"))  # this test's launch records only
    return VLLMLaunchSection(
        python=vllm_python,
        device="cpu",
        max_model_len=512,
        staging_dir=str(tmp_path / "staging"),
        startup_timeout_s=300,
    )


def test_foreign_server_already_on_the_port_is_refused_not_adopted(launch, smollm2_dir: Path):
    port = free_port()
    foreign = ForeignServer(port)
    try:
        with pytest.raises(WrongModel, match="someone-elses-model.*recipe's target model"):
            ensure_running(
                f"http://127.0.0.1:{port}",
                model=str(smollm2_dir),
                layer_ids=LAYER_IDS,
                hidden_size=576,
                launch=launch,
            )
    finally:
        foreign.close()
    assert not [r for r in foreign.requests if r[0] == "POST"], foreign.requests  # no extraction sent
    assert lifecycle.records() == []  # nothing launched beside it


def test_foreign_server_that_takes_the_port_during_the_lock_wait_is_not_adopted(
    launch, smollm2_dir: Path, caplog
):
    """The port is free when checked; while the launch waits for the CPU host lock, a foreign
    server binds it. The launched vLLM cannot bind; wait_healthy sees 200s that are not from its
    process group and fails, naming the foreign server, instead of returning a handle to it."""
    import fcntl

    caplog.set_level(logging.INFO)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    outcome: dict = {}
    lock = open(CPU_HOST_LOCK, "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)  # the launch waits here, as behind another run's server

    def run() -> None:
        try:
            outcome["handle"] = ensure_running(
                url, model=str(smollm2_dir), layer_ids=LAYER_IDS, hidden_size=576, launch=launch
            )
        except BaseException as err:
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    foreign = None
    try:
        deadline = time.monotonic() + 60
        while "waiting for it to stop" not in caplog.text:
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.1)
        foreign = ForeignServer(port)
        lock.close()  # the launch goes ahead on a port that is now someone else's
        thread.join(timeout=1200)  # other runs on this host may take the lock first
    finally:
        lock.close()
        if foreign is not None:
            foreign.close()
    assert not thread.is_alive()
    if "handle" in outcome:
        outcome["handle"].stop()
    error = outcome.get("error")
    assert isinstance(error, ServerStartError), outcome
    assert f"another server answers at {url}" in str(error), str(error)
    assert "not from the server just launched" in caplog.text
    assert not [r for r in foreign.requests if r[0] == "POST"], foreign.requests  # no extraction sent
    assert ("GET", "/health") in foreign.requests  # it was asked, and not believed
    assert lifecycle.records() == []  # the failed launch was cleaned up
