"""Retry policy and fast failures over real HTTP (a scripted stdlib server on loopback).

These need no vLLM: the script answers with fixed statuses so the number of requests the
client makes can be counted exactly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm.client import EndpointUnavailable, RequestFailed, VLLMClient
from draftflow.vllm.launch import free_port
from draftflow.vllm.server import EndpointDown, ensure_running


class ScriptedServer:
    """Answers each request with the next status of `statuses` (the last one repeats)."""

    def __init__(self, statuses: list[int]):
        self.statuses = list(statuses)
        self.requests: list[tuple[str, str, dict]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                owner.requests.append((self.command, self.path, dict(self.headers)))
                self.rfile.read(length)
                status = owner.statuses.pop(0) if len(owner.statuses) > 1 else owner.statuses[0]
                body = (
                    {"data": [{"id": "m", "root": "m"}]}
                    if status == 200
                    else {"error": {"message": f"scripted {status}"}}
                )
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    servers = []

    def make(statuses):
        servers.append(ScriptedServer(statuses))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def run(coro):
    return asyncio.run(coro)


async def _models(url, **kw):
    async with VLLMClient(url, backoff_s=0.01, **kw) as client:
        return await client.models()


def test_5xx_is_retried_with_backoff_then_succeeds(scripted):
    server = scripted([503, 500, 200])
    assert run(_models(server.url, retries=3)) == ["m"]
    assert len(server.requests) == 3


def test_5xx_gives_up_after_retries(scripted):
    server = scripted([502])
    with pytest.raises(RequestFailed) as info:
        run(_models(server.url, retries=2))
    assert info.value.status == 502 and "scripted 502" in str(info.value)
    assert len(server.requests) == 3


@pytest.mark.parametrize("status", [400, 401, 404])
def test_4xx_is_never_retried(scripted, status):
    server = scripted([status, 200])
    with pytest.raises(RequestFailed) as info:
        run(_models(server.url, retries=3))
    assert info.value.status == status
    assert len(server.requests) == 1


def test_api_key_is_sent_as_bearer(scripted):
    server = scripted([200])
    run(_models(server.url, api_key="s3cret"))
    assert server.requests[0][2].get("Authorization") == "Bearer s3cret"


def test_connection_refused_is_retried_then_reported():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(EndpointUnavailable, match="ConnectError"):
        run(_models(url, retries=2))
    assert time.monotonic() - start < 5


def test_health_of_dead_endpoint_is_false():
    async def go():
        async with VLLMClient(f"http://127.0.0.1:{free_port()}") as client:
            return await client.health()

    assert run(go()) is False


def test_dead_endpoint_without_launch_settings_fails_fast():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(EndpointDown, match="no `vllm.launch` section"):
        ensure_running(url, model="any/model", layer_ids=[2, 15, 27, 30], hidden_size=576)
    assert time.monotonic() - start < 5


def test_unroutable_endpoint_without_launch_settings_fails_fast():
    # 10.255.255.1 drops packets: the health probe's own timeout must bound the wait.
    start = time.monotonic()
    with pytest.raises(EndpointDown):
        ensure_running(
            "http://10.255.255.1:8000", model="m", layer_ids=[1], hidden_size=8, health_timeout_s=2
        )
    assert time.monotonic() - start < 5


def test_launch_is_refused_for_a_remote_host():
    with pytest.raises(EndpointDown, match="only be launched on this host"):
        ensure_running(
            "http://10.255.255.1:8000",
            model="m",
            layer_ids=[1],
            hidden_size=8,
            health_timeout_s=1,
            launch=VLLMLaunchSection(python="/bin/false", device="cpu"),
        )
