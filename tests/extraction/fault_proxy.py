"""A loopback HTTP proxy in front of the real vLLM server that injects faults into chosen requests.

vLLM cannot be asked to fail one prompt with a 5xx, or to answer one request late; this proxy
passes every request to the real server and, where a test's rule says so, answers 500 instead
or holds the real answer back for a while (so the client times out and retries while the
server has done the work). Everything else is the server's own answer, byte for byte.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from draftflow.vllm.launch import free_port

# rule(path, request body as JSON or None, how many times this body was seen) -> action:
# None (pass), ("status", code) or ("delay", seconds).
Rule = Callable[[str, dict | None, int], tuple | None]


class FaultProxy:
    def __init__(self, upstream: str, rule: Rule):
        self.upstream, self.rule = upstream.rstrip("/"), rule
        self.seen: Counter = Counter()
        self.lock = threading.Lock()
        self.port = free_port()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _relay(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                key = (self.path, json.dumps(body, sort_keys=True))
                with proxy.lock:
                    proxy.seen[key] += 1
                    count = proxy.seen[key]
                action = proxy.rule(self.path, body, count)
                if action and action[0] == "status":
                    blob = json.dumps({"error": {"message": "injected by the test proxy"}}).encode()
                    self._answer(action[1], blob, "application/json")
                    return
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                response = httpx.request(
                    method, proxy.upstream + self.path, content=raw, headers=headers, timeout=300
                )
                if action and action[0] == "delay":
                    time.sleep(action[1])
                self._answer(response.status_code, response.content, response.headers.get("content-type", ""))

            def _answer(self, status: int, blob: bytes, content_type: str) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(blob)))
                    self.end_headers()
                    self.wfile.write(blob)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (a timeout the test asked for)

            def do_GET(self):
                self._relay("GET")

            def do_POST(self):
                self._relay("POST")

        self.http = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()
