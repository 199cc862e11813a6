"""Fixtures for the Prefect tests: a real `prefect server start`, runners serving deployments in
subprocesses, and the SmolLM2 extraction server (from the session-wide `vllm_servers`).

The server is a subprocess on a free loopback port with its own PREFECT_HOME (SQLite); the
test process talks to it through PREFECT_API_URL (temporary settings), and so do the runners
(their environment). Everything started here is stopped by its process id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prefect_helpers import HERE, PREFECT, REPO, stop_group  # first: puts tests/extraction on sys.path

from draftflow.vllm.launch import free_port


@dataclass
class PrefectServer:
    api_url: str
    home: Path
    log: Path

    def env(self) -> dict[str, str]:
        """What a subprocess needs to use this server (and nothing of the test process's Prefect)."""
        return {"PREFECT_API_URL": self.api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free loopback port; PREFECT_API_URL points at it meanwhile."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect-server-home")
    port = free_port()
    log = home / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_SERVER_API_PORT=str(port),
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5",
    )  # schedules are tested with short intervals
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    api_url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prefect server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prefect server not healthy after 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        with (
            temporary_settings(updates={PREFECT_API_URL: api_url}),
            prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()),
        ):
            yield PrefectServer(api_url, home, log)
            drain_prefect_workers()  # logs and events still queued reach the server before it stops
    finally:
        stop_group(proc)


def drain_prefect_workers() -> None:
    """Send what this process's log and event workers still hold (as prefect_test_harness does)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=10, at_exit=False)
        except RuntimeError:  # never started
            pass


@dataclass
class Runner:
    """A runner (`serve`) or worker process; its stdout+stderr go to `log`."""

    proc: subprocess.Popen
    log: Path
    results: Path
    deployment_names: list[str] = field(default_factory=list)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="session")
def result_storage(tmp_path_factory) -> Path:
    """Persisted task results, shared by every runner (as a fleet would share a bucket)."""
    return tmp_path_factory.mktemp("prefect-results")


@pytest.fixture
def start_process(prefect_server: PrefectServer, result_storage: Path, tmp_path: Path):
    """start_process(argv, env={...}) -> Runner: a runner or worker in the repository root, with the
    server's URL, persisted results in `result_storage` and INFO logs; stopped after the test."""
    started: list[Runner] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> Runner:
        tag = uuid.uuid4().hex[:8]
        log = tmp_path / f"process-{tag}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        full_env.update(prefect_server.env())
        full_env.update(
            PREFECT_HOME=str(tmp_path / f"home-{tag}"),
            PREFECT_LOCAL_STORAGE_PATH=str(result_storage),
            PREFECT_RESULTS_PERSIST_BY_DEFAULT="true",
            PREFECT_RUNNER_POLL_FREQUENCY="1",
            PREFECT_WORKER_QUERY_SECONDS="1",
            PREFECT_LOGGING_LEVEL="INFO",
            PYTHONPATH=str(REPO),
            **(env or {}),
        )
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        started.append(Runner(proc, log, result_storage))
        return started[-1]

    yield start
    for runner in started:
        stop_group(runner.proc)


@pytest.fixture
def start_runner(start_process, prefect_server: PrefectServer, tmp_path: Path):
    """start_runner([{"flow": "flows.stages:extract", "name": ..., "parameters": ...}], env={...}) -> Runner
    serving those deployments; returns once the server lists them."""
    from prefect.client.orchestration import get_client

    def start(specs: list[dict], env: dict[str, str] | None = None) -> Runner:
        from prefect.settings import PREFECT_API_URL

        if PREFECT_API_URL.value() != prefect_server.api_url:  # the runner would serve elsewhere
            pytest.fail(f"this process talks to {PREFECT_API_URL.value()}, not {prefect_server.api_url}")
        spec_file = tmp_path / f"runner-{uuid.uuid4().hex[:8]}.json"
        spec_file.write_text(json.dumps(specs))
        runner = start_process([sys.executable, str(HERE / "serve_runner.py"), str(spec_file)], env)
        runner.deployment_names = [f"{import_flow_name(s['flow'])}/{s['name']}" for s in specs]
        deadline = time.monotonic() + 90
        with get_client(sync_client=True) as client:
            for name in runner.deployment_names:
                while True:
                    try:
                        client.read_deployment_by_name(name)
                        break
                    except Exception:
                        if runner.proc.poll() is not None or time.monotonic() > deadline:
                            pytest.fail(f"runner did not serve {name}:\n{runner.output()[-3000:]}")
                        time.sleep(0.5)
        return runner

    return start


def import_flow_name(spec: str) -> str:
    from importlib import import_module

    module, attribute = spec.split(":")
    return getattr(import_module(module), attribute).name
