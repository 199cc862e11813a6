"""Start and stop a vLLM server process; the pipeline talks to it only over HTTP.

vLLM is not a dependency of draftflow: it runs from its own virtualenv (``LaunchSpec.python``).
The server's log is kept in a file next to the run, and the process is stopped by pid
(SIGTERM to its process group, then SIGKILL) by whoever started it. It runs under
:mod:`draftflow.vllm.watchdog`, so it also dies when its launcher dies, and every launch is
recorded (:mod:`draftflow.vllm.lifecycle`) so that a later run can stop a survivor.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from draftflow.process_env import STORAGE_OPTIONS_ENV, VLLM_API_KEY_ENV
from draftflow.process_group import child_group_alive, group_listens_on, signal_group
from draftflow.recipe.load import expand
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm import lifecycle
from draftflow.vllm.engine_exit import engine_gone_for

log = logging.getLogger(__name__)

# Our CPU hidden-state connector lives in this package; the server imports it by module path.
CPU_CONNECTOR_MODULE = "draftflow.vllm.cpu_connector"
CPU_CONNECTOR_CLASS = "CPUHiddenStatesConnector"
STOCK_CONNECTOR_CLASS = "ExampleHiddenStatesConnector"
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
# Read by the draftflow vLLM plugin (plugins/draftflow_vllm_cpu/engine_start.py); without it, ignored.
CPU_ENGINE_START_ENV = "DRAFTFLOW_VLLM_CPU_ENGINE_START"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchSpec:
    """Everything needed to start one vLLM server."""

    python: str
    model: str
    port: int
    device: str  # the recipe's vllm.launch.device (no default here: the schema holds it)
    max_model_len: int  # likewise vllm.launch.max_model_len
    host: str = "127.0.0.1"
    dtype: str = "auto"
    extract_layer_ids: list[int] | None = None
    staging_dir: str | None = None
    speculative_config: dict | None = None
    cpu_reserved_cores: int | None = None  # the recipe's vllm.launch.cpu_reserved_cores (None: vLLM's choice)
    # the recipe's vllm.launch.cpu_engine_start (None: vLLM's choice); unset: the schema's default
    cpu_engine_start: str | None = VLLMLaunchSection.model_fields["cpu_engine_start"].default
    # Where operators put credentials (--api-key, HF_TOKEN): kept out of the repr.
    extra_args: list[str] = field(default_factory=list, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    log_path: str | None = None
    api_key: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def from_section(cls, launch: VLLMLaunchSection, *, model: str, port: int, **fields) -> LaunchSpec:
        """A server for ``model`` with the recipe's launch settings (python, device,
        max_model_len, extra_args, env); ``fields``: the rest (host, dtype, staging, log, ...)."""
        return cls(
            python=expand(launch.python),
            model=model,
            port=port,
            device=launch.device,
            max_model_len=launch.max_model_len,
            cpu_reserved_cores=launch.cpu_reserved_cores,
            cpu_engine_start=launch.cpu_engine_start,
            extra_args=list(launch.extra_args),
            env=dict(launch.env),
            **fields,
        )


def extraction_flags(layer_ids: list[int], staging_dir: str, device: str) -> list[str]:
    """The two JSON flags that turn on vLLM's native hidden-state extraction."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    kv = {
        "kv_connector": STOCK_CONNECTOR_CLASS,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": staging_dir},
    }
    if device == "cpu":
        # The stock connector pins memory and polls CUDA events: both crash on CPU hosts.
        kv["kv_connector"] = CPU_CONNECTOR_CLASS
        kv["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


def build_command(spec: LaunchSpec) -> list[str]:
    cmd = [
        spec.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--max-model-len",
        str(spec.max_model_len),
        "--dtype",
        spec.dtype,
    ]
    if spec.device == "cpu":
        cmd.append("--enforce-eager")
    if spec.extract_layer_ids:
        if spec.speculative_config:
            raise ValueError("a server either extracts hidden states or runs a drafter, not both")
        cmd += extraction_flags(
            spec.extract_layer_ids, spec.staging_dir or "/dev/shm/draftflow-hidden-states", spec.device
        )
    elif spec.speculative_config:
        cmd += ["--speculative-config", json.dumps(spec.speculative_config)]
    return cmd + list(spec.extra_args)


def build_env(spec: LaunchSpec) -> dict[str, str]:
    env = dict(os.environ)
    # draftflow's own secrets (store credentials, the client's copy of the API key) are none
    # of vLLM's business: a server's environment is readable by its plugins and in /proc.
    for name in (STORAGE_OPTIONS_ENV, VLLM_API_KEY_ENV):
        env.pop(name, None)
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"})
    if spec.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if spec.cpu_reserved_cores is not None:
            # vLLM keeps one core free of its OpenMP threads by default: half of a 2-core host.
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(spec.cpu_reserved_cores)
        if spec.cpu_engine_start is not None:
            env[CPU_ENGINE_START_ENV] = spec.cpu_engine_start
    # The server must import our connector (and plugins) without importing the rest of draftflow.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    if spec.api_key:
        env["VLLM_API_KEY"] = spec.api_key
    env.update(spec.env)
    return env


class ServerStartError(RuntimeError):
    pass


# On a CPU host each vLLM server binds its OpenMP threads to the cores; a second server
# started while one runs hangs in start-up without an error. CPU launches therefore take
# this host-wide lock for as long as their server runs, and wait for it (saying so).
# host_lock=False is for a server started beside one that holds the lock, once that one
# answers (LaunchServerFactory(side_by_side=True): interleaved speed rounds): with the pinned vLLM
# build, a server started beside one that already answers came up in every trial.
CPU_HOST_LOCK = Path(tempfile.gettempdir()) / "draftflow-vllm-cpu-host.lock"
# A refused /health costs a millisecond; polling often takes the tail off every start (a server
# is up on average half a poll interval before we look).
HEALTH_POLL_S = 0.2


def wait_for_host_lock(path: Path, timeout_s: float):
    """The host lock's open handle (closing it releases the lock), once no other server holds it.

    The wait usually runs in a task's worker thread. It gives up when the process is exiting (its
    main thread has finished, e.g. after SIGTERM): the interpreter joins worker threads at exit, and
    a thread waiting here would keep the stopped process alive for the whole timeout."""
    import fcntl
    import threading

    handle = open(path, "a+")
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if not announced:
                log.warning("another vLLM server runs on this CPU host; waiting for it to stop (%s)", path)
                announced = True
            # threading._SHUTTING_DOWN: set when the interpreter starts joining threads at exit,
            # before it runs the thread pools' exit hooks (the main thread counts as alive until after).
            if getattr(threading, "_SHUTTING_DOWN", False) or not threading.main_thread().is_alive():
                handle.close()
                raise ServerStartError(
                    "the process is exiting: stopped waiting for the host's vLLM lock"
                ) from None
            if time.monotonic() > deadline:
                handle.close()
                raise ServerStartError(
                    f"another vLLM server has held {path} for {timeout_s:.0f}s: "
                    "two servers on one CPU host hang at start-up; stop the other one"
                ) from None
            time.sleep(1.0)


class ServerProcess:
    """A vLLM server this process started (and therefore may stop)."""

    def __init__(self, spec: LaunchSpec, *, host_lock: bool = True, host_lock_timeout_s: float = 3600.0):
        self.spec = spec
        self.use_host_lock = host_lock
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._host_lock = None
        self.host_lock_timeout_s = host_lock_timeout_s
        self._launcher_pipe: int | None = None  # write end; the watchdog stops vLLM when it closes
        self.record: lifecycle.ServerRecord | None = None
        self.start_token: str | None = None

    def _take_host_lock(self) -> None:
        self._host_lock = wait_for_host_lock(CPU_HOST_LOCK, self.host_lock_timeout_s)

    def _release_host_lock(self) -> None:
        if self._host_lock is not None:
            self._host_lock.close()
            self._host_lock = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ServerProcess:
        log_path = self.spec.log_path or os.devnull
        if self.spec.log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        if self.spec.staging_dir:
            Path(self.spec.staging_dir).mkdir(parents=True, exist_ok=True)
        # A server a killed run left behind would answer on our port or hold the host lock.
        lifecycle.reap_orphans()
        if self.spec.device == "cpu" and self.use_host_lock:
            self._take_host_lock()
        self._log = open(log_path, "ab")
        self.start_token = lifecycle.new_start_token()
        env = build_env(self.spec)
        env[lifecycle.START_TOKEN_ENV] = self.start_token
        read_end, self._launcher_pipe = os.pipe()
        # The watchdog holds the host lock too (inherited), so the lock is free exactly when the
        # server is gone, however the launcher ended.
        keep = (read_end,) + ((self._host_lock.fileno(),) if self._host_lock is not None else ())
        try:
            self.proc = subprocess.Popen(
                [
                    self.spec.python,
                    "-m",
                    "draftflow.vllm.watchdog",
                    str(read_end),
                    "--",
                    *build_command(self.spec),
                ],
                env=env,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=keep,
            )
        finally:
            os.close(read_end)
        self.record = lifecycle.record_launch(
            self.proc.pid,
            self.spec.port,
            self.spec.host,
            self.start_token,
            self.spec.model,
            self.spec.log_path,
        )
        return self

    def log_tail(self, lines: int = 30) -> str:
        if not self.spec.log_path or not Path(self.spec.log_path).exists():
            return "(no log)"
        return "\n".join(Path(self.spec.log_path).read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float) -> None:
        """Until the server *this* process launched answers: /health is 200, the socket on the
        port belongs to its process group, and it serves the launched model. Any other server
        answering on the port (one found there after a long wait for the host lock) is not it."""
        deadline = time.monotonic() + timeout_s
        foreign = False  # something else answered on our port: say so when we fail
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self._foreign_note() if foreign else ''}vLLM exited with code {self.proc.returncode} "
                    f"during start-up; log tail:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    if self.answers_as_launched():
                        return
                    if not foreign:
                        log.warning(
                            "%s answers, but not from the server just launched; waiting for ours", self.url
                        )
                        foreign = True
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise ServerStartError(
            f"{self._foreign_note() if foreign else ''}vLLM not healthy after {timeout_s:.0f}s; "
            f"log tail:\n{self.log_tail()}"
        )

    def _foreign_note(self) -> str:
        return (
            f"another server answers at {self.url} (not the vLLM this run launched; it is never used "
            f"in its place): it holds port {self.spec.port}; stop it or give the endpoint another port. "
        )

    def answers_as_launched(self) -> bool:
        """The process group we launched listens on the port and serves the launched model."""
        if self.proc is None or not group_listens_on(self.proc.pid, self.spec.port):
            return False
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        try:
            served = httpx.get(f"{self.url}/v1/models", headers=headers, timeout=5).json().get("data", [])
        except (httpx.HTTPError, ValueError):
            return False
        return any(self.spec.model in (m.get("root"), m.get("id")) for m in served)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `grace_s`.

        Returns only once every process of the group is gone (the engine core and workers
        outlive the API server by a second or two): a server started right after would
        otherwise compete with them for the CPU cores they are bound to.
        """
        if self.proc is None:
            self._close_log()
            self._release_host_lock()
            self._close_pipe()
            return
        proc = self.proc  # start_new_session=True: the leader's pid is the group id
        if child_group_alive(proc):
            signal_group(
                proc.pid, grace_s, lambda: child_group_alive(proc), no_point_waiting=engine_gone_for()
            )
        self._close_log()
        self._release_host_lock()
        self._close_pipe()
        lifecycle.forget(self.record)
        self.record = None

    def _close_pipe(self) -> None:
        if self._launcher_pipe is not None:
            os.close(self._launcher_pipe)
            self._launcher_pipe = None

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
