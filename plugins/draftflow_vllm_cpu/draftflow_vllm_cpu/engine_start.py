"""vLLM's CPU build forks its engine-core process when the launcher asks for it.

A vLLM 0.32 server on CPU is three processes: the API server, the engine core it starts, and the
worker the engine core starts. The CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
unconditionally while it checks the engine config (``CpuPlatform.check_and_update_config``), so
both children are fresh interpreters that import torch and vLLM again: on a 2-core host the
engine core's imports are about 9 of a 30-second start.

Only the worker needs a fresh interpreter. vLLM pins the worker's OpenMP threads to their cores
through environment variables (``GOMP_CPU_AFFINITY`` and friends, set just before the worker
starts), which OpenMP reads once, when it is loaded. A forked worker inherits its parent's
already-loaded OpenMP, runs unpinned, and decodes about 30% slower (measured). The engine core
only schedules, so forking it costs nothing at decode time.

When ``DRAFTFLOW_VLLM_CPU_ENGINE_START`` is ``fork`` (draftflow's launcher sets it from the recipe's
``vllm.launch.cpu_engine_start``), the API server starts the engine core by fork, and the engine
core starts its worker by spawn, as vLLM would. ``spawn`` or unset: vLLM's own choice, spawn.
vLLM's other reasons to spawn (CUDA initialised, a Ray actor, ``--numa-bind``) are checked when a
process starts, and still win.

A forked child also inherits the API server's open descriptors, among them its HTTP socket: a
forked engine core that outlives a killed API server would keep the port bound, accepting
connections nobody answers, and a server restarted on that port would hang. The child drops every
inherited TCP server socket (bound, with no peer) at fork time.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket

#: The name draftflow asks for (keep it stable).
FIX = "cpu-engine-start-from-env"
ENV = "DRAFTFLOW_VLLM_CPU_ENGINE_START"
METHODS = ("fork", "spawn")
VLLM_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_WRAPPED = "_draftflow_engine_start"
log = logging.getLogger("vllm.draftflow_vllm_cpu")  # under "vllm": vLLM's log handlers print it


def install(platform_class) -> bool:
    """In the API server, have the engine core forked; False if nothing is asked."""
    method = os.environ.get(ENV)
    if method is None:
        return False
    if method not in METHODS:
        raise ValueError(f"{ENV}={method!r}: expected one of {', '.join(METHODS)}")
    if not _is_api_server():
        return True  # a process vLLM started: what it starts keeps vLLM's choice
    stock = platform_class.check_and_update_config  # a classmethod, bound to the class
    if getattr(stock, _WRAPPED, False):
        return True

    def check_and_update_config(cls, vllm_config) -> None:
        stock.__func__(cls, vllm_config)
        if _is_api_server() and os.environ.get(VLLM_ENV) != method:
            os.environ[VLLM_ENV] = method
            log.info(
                "draftflow-vllm-cpu: the engine core starts by %s, its worker by spawn (%s)", method, ENV
            )

    setattr(check_and_update_config, _WRAPPED, True)
    platform_class.check_and_update_config = classmethod(check_and_update_config)
    # A forked child inherits this environment but not vLLM's call that set it; vLLM loads no
    # plugin again in a forked child either. So the reset to spawn is done here, at fork time.
    os.register_at_fork(after_in_child=_children_of_a_fork_spawn)
    return True


def _children_of_a_fork_spawn() -> None:
    os.environ[VLLM_ENV] = "spawn"
    drop_server_sockets()


def drop_server_sockets() -> None:
    """Point every TCP server socket of this process at /dev/null, keeping its descriptor
    number taken: the inherited socket object still closes that number when it is collected,
    which must not hit a descriptor opened later. The parent's socket is untouched."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd != null and _is_server_socket(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)


def _is_server_socket(fd: int) -> bool:
    """A TCP socket bound to a port with no peer: listening, or about to (vLLM binds its HTTP
    socket before it starts the engine and listens on it only once the engine is up)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False  # not a socket, or closed since the listing
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return False
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return True
        try:
            sock.getpeername()
            return False  # a connection
        except OSError:
            return sock.getsockname()[1] != 0
    finally:
        sock.detach()  # the descriptor is not ours to close


def _is_api_server() -> bool:
    """The server's first process (started by a launcher, not by vLLM's multiprocessing)."""
    return multiprocessing.parent_process() is None
