"""Make sure the vLLM endpoint(s) a pipeline needs are up, serve the right target, and extract
the right layers — starting a server only when none answers and launch settings exist.

A server that answers is *checked*, never trusted: it must serve the expected model and a
probe extraction must return a file with the expected layer count, hidden size and token ids.
A server this module starts is stopped by the returned handle; one it did not start never is.

Layer *ids* (as opposed to their count) cannot be checked over HTTP: the file carries no
metadata, and vLLM 0.32 exposes them nowhere (not even dev mode's ``/server_info``, which
dumps the draft config without its ``hf_config``). For servers started here they are right
by construction; for others only count and hidden size are checked, the handle's
``unverified`` list says so, and ``strict_layer_ids=True`` refuses such servers instead.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from draftflow.recipe.load import default_home, expand
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm import lifecycle
from draftflow.vllm.adopted import (  # noqa: F401  (re-exported: callers catch them from here)
    LOCAL_HOSTS,
    PROBE_TOKENS,
    PortHeldByAnotherRun,
    WrongServerSettings,
    check_adopted_settings,
    is_local,
    refuse_another_runs_server,
)
from draftflow.vllm.client import (
    RETRYABLE_STATUS_MIN,
    EndpointUnavailable,
    ExtractionNotEnabled,
    RequestFailed,
    VLLMClient,
    auth_headers,
    completion_payload,
    error_message,
    hidden_states_path,
    read_hidden_states,
)
from draftflow.vllm.errors import ServerCheckError
from draftflow.vllm.launch import LaunchSpec, ServerProcess

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PROBE_TOKENS = PROBE_TOKENS  # only shapes are checked
MAX_RESTARTS = 3  # server restarts one piece of work (a shard) may wait for before it fails
DEAD_AFTER_S = 60.0  # a live server that has not answered /health for this long is taken for hung


class EndpointDown(ServerCheckError):
    """Nothing healthy answers and there are no launch settings to start a server."""


class WrongModel(ServerCheckError):
    """The endpoint serves another model than the recipe's target."""


class WrongLayers(ServerCheckError):
    """The endpoint extracts other layers (count, ids or hidden size) than the recipe asks for."""


@dataclass
class ServerHandle:
    """The checked endpoints; stops (only) the servers `ensure_running` started. A context manager."""

    endpoints: list[str]
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr or log line
    started: list[ServerProcess] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)  # checks that could not be made, one line each
    staging_dirs: list[str] = field(default_factory=list)  # the only folders whose files are read/deleted
    # Starts (and checks) a server at a URL again; set when ensure_running had launch settings.
    relaunch: Callable[[str], ServerProcess] | None = field(default=None, repr=False)
    restarts: int = field(default=0, init=False)  # rounds of restart_dead that restarted servers
    # One lock for every caller (CLI coroutines in worker threads, Prefect shard tasks in threads).
    _restart_lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    @property
    def log_paths(self) -> list[str]:
        return [p.spec.log_path for p in self.started if p.spec.log_path]

    def client(self, **kwargs: Any) -> VLLMClient:
        kwargs.setdefault("staging_dirs", self.staging_dirs)
        return VLLMClient(self.endpoints, api_key=self.api_key, **kwargs)

    def revive(self, url: str) -> bool:
        """Start the server at `url` again after it died mid-run (ours, or one adopted that
        went away); False when there are no launch settings to do it with."""
        if self.relaunch is None:
            return False
        for proc in [p for p in self.started if p.url.rstrip("/") == url.rstrip("/")]:
            proc.stop()
            self.started.remove(proc)
        log.warning("vLLM at %s stopped answering; starting it again", url)
        self.started.append(self.relaunch(url))
        return True

    def is_dead(self, url: str, window_s: float | None = None) -> bool:
        """Whether the server at ``url`` is gone, as opposed to busy: one we started whose process
        exited, nothing listening on the port, or no answer to /health for ``window_s``. A server
        that answers at all within the window is alive, however slowly."""
        window_s = DEAD_AFTER_S if window_s is None else window_s
        if any(not p.alive() for p in self.started if p.url.rstrip("/") == url.rstrip("/")):
            return True
        deadline = time.monotonic() + window_s
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=10.0).status_code == 200:
                    return False
            except httpx.ConnectError:
                return True  # nothing listens there
            except httpx.HTTPError:
                pass  # no answer in time: busy, or hung
            if time.monotonic() >= deadline:
                return True
            time.sleep(2.0)

    def restart_dead(self, seen: int) -> bool:
        """After work failed because a server went away: start every endpoint that no longer
        answers again, once for all the callers that saw it fail (they fail together). `seen` is
        :attr:`restarts` as the caller read it before its attempt. True when it should try again."""
        if self.relaunch is None:
            return False
        with self._restart_lock:
            if self.restarts != seen:  # another caller restarted them meanwhile
                return True
            for url in self.endpoints:
                if self.is_dead(url) and not self.revive(url):
                    return False
            self.restarts += 1
            return True

    def stop(self) -> None:
        for proc in self.started:
            proc.stop()
        atexit.unregister(self.stop)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_went_away(outcome: object) -> bool:
    """Whether a failure is the server's, not the work's: no connection, or a 5xx after the
    client's retries (what a restart may cure)."""
    if isinstance(outcome, EndpointUnavailable):
        return True
    return isinstance(outcome, RequestFailed) and outcome.status >= RETRYABLE_STATUS_MIN


async def with_restarts(attempt: Callable[[], Awaitable[T]], server: ServerHandle | None) -> T:
    """``await attempt()``; when it fails because a server died (connection refused, 5xx after
    the client's retries) and `server` can start it again, restart and retry, up to MAX_RESTARTS
    times. The attempt must be safe to repeat whole (a shard commits nothing until it is done)."""
    for tries in itertools.count():
        seen = server.restarts if server is not None else 0
        try:
            return await attempt()
        except (EndpointUnavailable, RequestFailed) as err:
            if not server_went_away(err) or server is None or tries >= MAX_RESTARTS:
                raise
            if not await asyncio.to_thread(server.restart_dead, seen):
                raise
    raise AssertionError("unreachable")


def ensure_running(
    endpoints: str | Sequence[str],
    *,
    model: str,
    layer_ids: Sequence[int],
    hidden_size: int,
    api_key: str | None = None,
    launch: VLLMLaunchSection | None = None,
    dtype: str = "auto",
    log_dir: str | Path | None = None,
    probe_token_ids: Sequence[int] = DEFAULT_PROBE_TOKENS,
    health_timeout_s: float = 3.0,
    strict_layer_ids: bool = False,
    staging_dirs: Sequence[str] = (),
    min_model_len: int | None = None,
) -> ServerHandle:
    """Check every endpoint; start the dead ones when `launch` is given (else fail fast).

    `launch` is the recipe's (or a VLLMServer block's) ``vllm.launch`` section. `model` is the
    recipe's target, as the server would be started with it.
    With `strict_layer_ids`, a running server not started here is refused, because its layer
    ids (beyond their count) cannot be verified. `staging_dirs`: where servers may name
    hidden-state files (the launch section's staging_dir is added); files elsewhere are refused.
    A server that answers but was not started here must also compute in `dtype` (or float32)
    and take `min_model_len` tokens; one another live draftflow run started is never used.
    """
    urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    urls = [u.rstrip("/") for u in urls]
    model = expand(model)
    # A server a killed run left behind would otherwise pass as "not started by draftflow".
    lifecycle.reap_orphans()
    handle = ServerHandle(endpoints=urls, api_key=api_key, staging_dirs=[expand(d) for d in staging_dirs])
    if launch is not None:
        handle.staging_dirs.append(expand(launch.staging_dir))

    def check(url: str) -> dict:
        return check_endpoint(
            url,
            model,
            layer_ids,
            hidden_size,
            api_key,
            probe_token_ids,
            health_timeout_s,
            handle.staging_dirs,
        )

    def launch_checked(url: str) -> ServerProcess:
        proc = start_server(url, model, layer_ids, api_key, launch, dtype, log_dir)
        try:
            check(url)
        except BaseException:
            proc.stop()
            raise
        return proc

    if launch is not None:
        handle.relaunch = launch_checked
    atexit.register(handle.stop)  # a crashed pipeline must not leave our servers running
    try:
        for url in urls:
            if launch is not None:  # a run that starts its own servers never shares another run's
                refuse_another_runs_server(url)
            if is_healthy(url, health_timeout_s):
                served = check(url)
                unchecked = check_adopted_settings(url, served, dtype, min_model_len)
                note = (
                    f"{url}: server not started by draftflow; its layer ids cannot be read over HTTP, "
                    f"only their count ({len(layer_ids)}) and the hidden size ({hidden_size}) were checked"
                )
                if strict_layer_ids:
                    raise WrongLayers(
                        f"{note}; strict_layer_ids refuses it: stop it and let the pipeline start one"
                    )
                for line in (note, *unchecked):
                    log.warning(line)
                handle.unverified += [note, *unchecked]
                continue
            if launch is None:
                raise EndpointDown(
                    f"no healthy vLLM server at {url} (GET /health failed) and the recipe has no "
                    "`vllm.launch` section to start one: start the server or add launch settings"
                )
            handle.started.append(launch_checked(url))
    except BaseException:
        handle.stop()
        raise
    return handle


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


def is_healthy(url: str, timeout_s: float = 3.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def check_endpoint(
    url: str,
    model: str,
    layer_ids: Sequence[int],
    hidden_size: int,
    api_key: str | None,
    probe_token_ids: Sequence[int],
    timeout_s: float,
    staging_dirs: Sequence[str] = (),
) -> dict:
    """Model served and a probe extraction's layer count, hidden size and tokens; returns the
    served model's /v1/models entry."""
    headers = auth_headers(api_key)
    with httpx.Client(base_url=url, headers=headers, timeout=max(timeout_s, 60.0)) as http:
        served = _get_json(http, url, "/v1/models").get("data", [])
        served_id = check_model(url, model, served)
        check_extraction(http, url, served_id, layer_ids, hidden_size, probe_token_ids, staging_dirs)
    return next(e for e in served if e.get("id") == served_id)


def _get_json(http: httpx.Client, url: str, path: str) -> dict:
    response = http.get(path)
    if response.status_code in (401, 403):
        raise ServerCheckError(
            f"{url}{path}: HTTP {response.status_code}: the API key was rejected or is missing"
        )
    if response.status_code >= 400:
        raise ServerCheckError(f"{url}{path}: HTTP {response.status_code}: {error_message(response)}")
    return response.json()


def same_model(expected: str, served: str) -> bool:
    """Equal ids, or the same local folder spelt differently (trailing '/', symlinks)."""

    def norm(name: str) -> str:
        path = Path(name).expanduser()
        return str(path.resolve()) if path.exists() else name.rstrip("/")

    return expected == served or norm(expected) == norm(served)


def check_model(url: str, expected: str, served: list[dict]) -> str:
    """The served model id that is the expected target; WrongModel naming both otherwise."""
    for entry in served:
        # `root` is the model vLLM loaded; `id` may be a --served-model-name alias.
        if any(same_model(expected, entry.get(k) or "") for k in ("id", "root")):
            return entry["id"]
    names = ", ".join(repr(e.get("root") or e.get("id")) for e in served) or "no model"
    raise WrongModel(f"{url} serves {names}, but the recipe's target model is {expected!r}")


def check_extraction(
    http: httpx.Client,
    url: str,
    served_id: str,
    layer_ids: Sequence[int],
    hidden_size: int,
    probe_token_ids: Sequence[int],
    staging_dirs: Sequence[str] = (),
) -> None:
    """One real extraction: the file must have the expected layers, size and tokens."""
    prompt = [int(t) for t in probe_token_ids]
    response = http.post(
        "/v1/completions",
        json=completion_payload(served_id, prompt),
        headers={"X-Request-Id": f"draftflow-probe-{time.time_ns()}"},
    )
    if response.status_code >= 400:
        raise ServerCheckError(
            f"{url}: probe extraction failed: HTTP {response.status_code}: {error_message(response)}"
        )
    try:
        path = hidden_states_path(response.json(), url, prompt, staging_dirs)
    except ExtractionNotEnabled as err:
        raise ExtractionNotEnabled(
            f"{url} serves {served_id!r} but hidden-state extraction is not enabled: {err}"
        ) from None
    _, hidden = read_hidden_states(path, prompt)  # validates token ids, finiteness; deletes files
    if hidden.shape[1] != len(layer_ids):
        raise WrongLayers(
            f"{url} extracts {hidden.shape[1]} layers per token, but the recipe expects "
            f"{len(layer_ids)} (layer ids {list(layer_ids)})"
        )
    if hidden.shape[2] != hidden_size:
        raise WrongLayers(
            f"{url} returns hidden size {hidden.shape[2]}, but the target's hidden size is {hidden_size}"
        )


# ---------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------


def start_server(
    url: str,
    model: str,
    layer_ids: Sequence[int],
    api_key: str | None,
    launch: VLLMLaunchSection,
    dtype: str,
    log_dir: str | Path | None,
) -> ServerProcess:
    """Start vLLM with the extraction flags at `url`'s port and wait for /health."""
    parts = urlsplit(url)
    if parts.hostname not in LOCAL_HOSTS | {socket.gethostname()}:
        raise EndpointDown(f"no healthy vLLM server at {url}, and a server can only be launched on this host")
    if parts.port is None:
        raise EndpointDown(f"{url}: give an explicit port to launch a server there")
    log_root = Path(log_dir) if log_dir else default_home() / "logs"
    log_path = log_root / f"vllm-{parts.port}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    spec = LaunchSpec.from_section(
        launch,
        model=model,
        host=parts.hostname,
        port=parts.port,
        dtype=dtype,
        extract_layer_ids=list(layer_ids),
        staging_dir=expand(launch.staging_dir),
        log_path=str(log_path),
        api_key=api_key,
    )
    if not Path(spec.python).exists():
        raise ServerCheckError(f"vllm.launch.python {spec.python} does not exist")
    log.info("starting vLLM for %s at %s (log: %s)", model, url, log_path)
    proc = ServerProcess(spec).start()
    try:
        proc.wait_healthy(launch.startup_timeout_s)
    except BaseException:
        proc.stop()
        raise
    return proc
