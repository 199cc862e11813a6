"""Checks on a vLLM server that answers but was not started by this run, before it is used.

A recipe may point at a server someone started (``vllm.endpoints`` without launch settings, or
one already up). It is used only when it is what the stage needs: the recipe's model (checked
by the callers), hidden-state extraction on for extraction and off for generation, a dtype and a
context length that fit. A run with launch settings never uses a server another draftflow run
started: its settings are that run's, and it stops when that run is done with it.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from draftflow.process_group import command_line, listener_of
from draftflow.vllm import lifecycle
from draftflow.vllm.errors import InvalidHiddenStates, ServerCheckError
from draftflow.vllm.hidden_states_file import discard_hidden_states, staging_path

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
# Any ids will do for a probe: every vocabulary has them.
PROBE_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8)


class WrongServerSettings(ServerCheckError):
    """The endpoint runs with other settings than the stage needs (extraction on/off, dtype, length)."""


class PortHeldByAnotherRun(ServerCheckError):
    """A local endpoint's port is held by a server another live draftflow run launched."""


def is_local(url: str) -> bool:
    return urlsplit(url).hostname in LOCAL_HOSTS | {socket.gethostname()}


def refuse_another_runs_server(url: str) -> None:
    """PortHeldByAnotherRun when a local endpoint's port is held by a server another draftflow
    run started. Called for runs with launch settings: they start their own servers, and another
    run's has that run's settings and stops when that run is done with it. A recipe without
    launch settings was told to use the endpoint: its server is checked like any other."""
    port = urlsplit(url).port
    if port is None or not is_local(url):
        return
    other = lifecycle.another_runs_server(port)
    if other is None:
        return
    by = (
        f"pid {other.launcher_pid}: {other.launcher_command[:300]}"
        if other.launcher_pid
        else f"a run that has ended: stop it with `kill -TERM -{other.pgid}`"
    )
    raise PortHeldByAnotherRun(
        f"port {port} on this host is held by a vLLM server another draftflow run started (pid "
        f"{other.pid}: {other.command[:300]}; started by {by}). A run with launch settings never uses "
        "another run's server: wait for that run to end, give this recipe another port in "
        "vllm.endpoints, or remove vllm.launch to use that server as it is"
    )


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``name`` (``--x V`` or ``--x=V``) in a command line; None when absent."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def check_adopted_settings(url: str, served: dict, dtype: str, min_model_len: int | None) -> list[str]:
    """For a server not started here: its context length (from /v1/models) and, when it runs on
    this host, its dtype (from its command line; float32 serves any stage). Returns notes on
    what could not be checked."""
    length = served.get("max_model_len")
    if min_model_len is not None and isinstance(length, int) and length < min_model_len:
        raise WrongServerSettings(
            f"{url} takes at most {length} tokens (max_model_len), but the recipe's samples need "
            f"{min_model_len}: restart it with --max-model-len {min_model_len} or more"
        )
    if dtype == "auto":
        return []
    pid = listener_of(urlsplit(url).port or 0) if is_local(url) else None
    args = command_line(pid) if pid is not None else []
    if not any("vllm" in arg for arg in args):  # another host, or a proxy in front of vLLM
        return [f"{url}: the server's dtype cannot be read from here; it should compute in {dtype}"]
    served_dtype = flag_value(args, "--dtype") or "auto"
    if served_dtype not in (dtype, "float32"):
        raise WrongServerSettings(
            f"{url} computes in {served_dtype} (its --dtype), but this stage needs {dtype}: restart it "
            f"with --dtype {dtype}, or stop it and let draftflow start one (vllm.launch)"
        )
    return []


def extraction_enabled(http: httpx.Client, url: str, served_id: str, staging_dirs: Sequence[str]) -> bool:
    """Whether the server writes hidden states for a completion (one probe request). A file it
    names inside our staging folders is deleted; one elsewhere is not ours and stays."""
    prompt = list(PROBE_TOKENS)
    response = http.post("/v1/completions", json={"model": served_id, "prompt": prompt, "max_tokens": 1})
    if response.status_code >= 400:
        raise ServerCheckError(
            f"{url}: probe completion failed: HTTP {response.status_code}: {response.text[:300]}"
        )
    path = (response.json().get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        return False
    try:
        discard_hidden_states(staging_path(path, staging_dirs))
    except InvalidHiddenStates:
        pass  # outside our staging folders: not ours to delete
    return True
