"""Which vLLM servers draftflow launched on this host, and what to do with the ones left behind.

Every launch writes a small record (``$DRAFTFLOW_HOME/run/vllm-servers/PORT-TOKEN.json``):
the server's process group, its port, a random start token (also in the server's
environment), and the launcher's pid, each with the process start time. A record is removed
when its launcher stops the server.

Servers die with their launcher (see :mod:`draftflow.vllm.watchdog`). Should one survive
anyway (its watchdog frozen or killed in an odd order), the next launch or check on this
host finds a record whose launcher is gone and stops that orphan before doing anything
else: it is never adopted as "a server draftflow did not start", and no second server is
started beside it on its port or under the CPU host lock it holds.

A record is only a claim. Before anything is signalled the group must prove it is the one
launched (:func:`draftflow.process_group.group_is_ours`: the leader's start time, and the
start token in a member's environment). A group that cannot (its id reused by someone else,
or not ours to inspect), and a record older than :data:`RECORD_MAX_AGE_S`, is forgotten and
nothing is touched.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from draftflow.process_group import (
    command_line,
    environment_value,
    group_alive,
    group_is_ours,
    group_of,
    is_running,
    listener_of,
    parent_of,
    signal_group,
    start_time,
)
from draftflow.recipe.load import default_home
from draftflow.vllm.engine_exit import engine_gone_for

log = logging.getLogger(__name__)

START_TOKEN_ENV = "DRAFTFLOW_VLLM_START_TOKEN"
#: A record of a server started longer ago than this is dropped without touching anything:
#: ownership proofs get no better with age, and a stale record must not be acted on forever.
RECORD_MAX_AGE_S = 7 * 24 * 3600.0
_launched_here: set[str] = set()  # start tokens of the servers this process launched and still runs


def state_dir() -> Path:
    return default_home() / "run" / "vllm-servers"


def new_start_token() -> str:
    return uuid.uuid4().hex


@dataclass
class ServerRecord:
    """One launched server, as its record file holds it (start times: seconds since the epoch)."""

    pgid: int
    server_started: float | None
    port: int
    host: str
    token: str
    model: str
    launcher_pid: int
    launcher_started: float | None
    log_path: str | None = None
    path: str = ""

    def launcher_alive(self) -> bool:
        return is_running(self.launcher_pid, self.launcher_started)

    def expired(self, now: float | None = None) -> bool:
        started = self.server_started
        return started is None or (now or time.time()) - started > RECORD_MAX_AGE_S

    def server_is_ours(self) -> bool:
        """The recorded group still runs and proves it is the server launched (start time and token)."""
        return group_is_ours(self.pgid, self.server_started, START_TOKEN_ENV, self.token)


def record_launch(
    pgid: int, port: int, host: str, token: str, model: str, log_path: str | None
) -> ServerRecord:
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    record = ServerRecord(
        pgid=pgid,
        server_started=start_time(pgid),
        port=port,
        host=host,
        token=token,
        model=model,
        launcher_pid=me,
        launcher_started=start_time(me),
        log_path=log_path,
        path=str(folder / f"{port}-{token}.json"),
    )
    _launched_here.add(token)
    tmp = record.path + f".tmp-{me}"
    Path(tmp).write_text(json.dumps(asdict(record)))
    os.replace(tmp, record.path)
    return record


def forget(record: ServerRecord | None) -> None:
    if record is not None:
        _launched_here.discard(record.token)
        Path(record.path).unlink(missing_ok=True)


def records() -> list[ServerRecord]:
    out = []
    for path in sorted(state_dir().glob("*.json")):
        try:
            data = json.loads(path.read_text())
            data["path"] = str(path)
            out.append(ServerRecord(**data))
        except (OSError, ValueError, TypeError):
            log.warning("ignoring unreadable vLLM server record %s", path)
    return out


@dataclass(frozen=True)
class ForeignLaunch:
    """A vLLM server on this host that another draftflow process launched."""

    pid: int  # the process listening on the port
    pgid: int | None
    command: str
    launcher_pid: int | None  # the process that started it, while it lives
    launcher_command: str


def another_runs_server(port: int) -> ForeignLaunch | None:
    """The server listening on ``port`` when draftflow launched it (a start token in its
    environment, whatever ``$DRAFTFLOW_HOME`` that run used) but not this process; else None."""
    pid = listener_of(port)
    if pid is None:
        return None
    token = environment_value(pid, START_TOKEN_ENV)
    if token is None or token in _launched_here:
        return None
    pgid = group_of(pid)
    launcher = parent_of(pgid)  # the group's leader is the watchdog, its launcher's child
    launcher = None if launcher in (None, 1) else launcher  # 1: the launcher is gone (an orphan)
    return ForeignLaunch(
        pid=pid,
        pgid=pgid,
        command=" ".join(command_line(pid)),
        launcher_pid=launcher,
        launcher_command=" ".join(command_line(launcher)) if launcher else "",
    )


def reap_orphans(grace_s: float = 20.0) -> list[ServerRecord]:
    """Stop every recorded server whose launcher is gone; returns the ones that were stopped.

    A server whose launcher lives belongs to a live run and is left alone. Every other record
    is removed: its server stopped when it proves to be ours, left untouched otherwise.
    """
    reaped = []
    for record in records():
        if record.launcher_alive():
            continue
        if record.expired():
            log.warning(
                "forgetting vLLM server record %s: older than %d days; process group %d is left alone",
                record.path,
                RECORD_MAX_AGE_S // 86400,
                record.pgid,
            )
        elif record.server_is_ours():
            log.warning(
                "stopping vLLM left running by a killed draftflow run (process group %d, port %d, launcher "
                "pid %d gone; log %s)",
                record.pgid,
                record.port,
                record.launcher_pid,
                record.log_path,
            )
            try:
                stop_group(record.pgid, grace_s)
                reaped.append(record)
            except PermissionError:
                log.warning("not allowed to signal process group %d: not ours; left alone", record.pgid)
        elif group_alive(record.pgid):
            log.info(
                "forgetting vLLM server record %s: process group %d runs but is not the server launched "
                "(start time or start token differ); left alone",
                record.path,
                record.pgid,
            )
        forget(record)
    return reaped


def stop_group(pgid: int, grace_s: float) -> None:
    signal_group(pgid, grace_s, lambda: group_alive(pgid), no_point_waiting=engine_gone_for())
