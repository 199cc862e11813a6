"""Which vLLM servers draftflow launched on this host, and what to do with the ones left behind.

Every launch writes a small record (``$DRAFTFLOW_HOME/run/vllm-servers/PORT-TOKEN.json``):
the server's process group, its port, a random start token (also in the server's
environment), and the launcher's pid, each with the process start time so that a reused pid
is never mistaken for ours. A record is removed when its launcher stops the server.

Servers die with their launcher (see :mod:`draftflow.vllm.watchdog`). Should one survive
anyway (its watchdog frozen or killed in an odd order), the next launch or check on this
host finds a record whose launcher is gone and stops that orphan before doing anything
else: it is never adopted as "a server draftflow did not start", and no second server is
started beside it on its port or under the CPU host lock it holds.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from draftflow.process_group import live_members, signal_group
from draftflow.recipe.load import default_home
from draftflow.vllm.engine_exit import engine_gone_for

log = logging.getLogger(__name__)

START_TOKEN_ENV = "DRAFTFLOW_VLLM_START_TOKEN"


def state_dir() -> Path:
    return default_home() / "run" / "vllm-servers"


def new_start_token() -> str:
    return uuid.uuid4().hex


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22); None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw.rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    state, start = fields[0], fields[19]
    return None if state == "Z" else int(start)


def is_alive(pid: int, started: int | None) -> bool:
    """True when `pid` runs and is the same process as when `started` was read."""
    now = process_start_time(pid)
    return now is not None and (started is None or now == started)


@dataclass
class ServerRecord:
    """One launched server, as its record file holds it."""

    pgid: int
    server_started: int | None
    port: int
    host: str
    token: str
    model: str
    launcher_pid: int
    launcher_started: int | None
    log_path: str | None = None
    path: str = ""

    def launcher_alive(self) -> bool:
        return is_alive(self.launcher_pid, self.launcher_started)

    def server_alive(self) -> bool:
        return is_alive(self.pgid, self.server_started) or _group_alive(self.pgid)


def record_launch(
    pgid: int, port: int, host: str, token: str, model: str, log_path: str | None
) -> ServerRecord:
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    record = ServerRecord(
        pgid=pgid,
        server_started=process_start_time(pgid),
        port=port,
        host=host,
        token=token,
        model=model,
        launcher_pid=me,
        launcher_started=process_start_time(me),
        log_path=log_path,
        path=str(folder / f"{port}-{token}.json"),
    )
    tmp = record.path + f".tmp-{me}"
    Path(tmp).write_text(json.dumps(asdict(record)))
    os.replace(tmp, record.path)
    return record


def forget(record: ServerRecord | None) -> None:
    if record is not None:
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


def reap_orphans(grace_s: float = 20.0) -> list[ServerRecord]:
    """Stop every recorded server whose launcher is gone; returns the ones that were still running.

    Records of servers that are gone are removed too. A server whose launcher lives belongs
    to a live run and is left alone.
    """
    reaped = []
    for record in records():
        if record.launcher_alive():
            continue
        if record.server_alive():
            log.warning(
                "stopping vLLM left running by a killed draftflow run (process group %d, port %d, launcher "
                "pid %d gone; log %s)",
                record.pgid,
                record.port,
                record.launcher_pid,
                record.log_path,
            )
            stop_group(record.pgid, grace_s)
            reaped.append(record)
        forget(record)
    return reaped


def stop_group(pgid: int, grace_s: float) -> None:
    signal_group(pgid, grace_s, lambda: _group_alive(pgid), no_point_waiting=engine_gone_for())


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(live_members(pgid))  # killpg counts zombies; a group of zombies only is gone


def listening_socket_inodes(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on `port` (any address), from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], int(parts[9])
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def group_listens_on(pgid: int, port: int) -> bool:
    """True when a process of group `pgid` holds the socket listening on `port`: the server that
    answers there is that group's, not one that was already on the port."""
    inodes = {f"socket:[{i}]" for i in listening_socket_inodes(port)}
    if not inodes:
        return False
    for pid in live_members(pgid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
            except OSError:
                continue
    return False
