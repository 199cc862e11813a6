"""The suite's bookkeeping: which servers each test starts, how many start-ups a run costs, and a
JSON report of durations and markers that `scripts/suite_budget.py` checks.

A census thread looks at this process's descendants once a second and names the servers among
them (vLLM, Prefect, S3, torchrun); `subprocess.Popen` and moto's in-process server report
themselves at once. A test without the `slow` marker that starts one fails: `make test-fast`
promises no servers, and this is what keeps the promise.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

CENSUS_INTERVAL_S = 1.0


def server_kind(argv: list[str]) -> str | None:
    """The kind of server a command line starts, or None. The vLLM watchdog is not counted: its
    api_server child is, so one launch counts once."""
    args = [str(a) for a in argv]
    joined = " ".join(args)
    module = args[args.index("-m") + 1] if "-m" in args[:-1] else ""
    names = {Path(a).name for a in args[:2]}
    if module == "vllm.entrypoints.openai.api_server" or ("vllm" in names and "serve" in args[1:2]):
        return "vLLM"
    if module == "draftflow.vllm.watchdog":
        return None
    if "prefect.server.api.server" in joined or (
        "server" in args and "start" in args and "prefect" in joined and "--help" not in args
    ):  # `prefect server start --help` (the docs' command check) prints usage only
        return "Prefect server"
    if "moto_server" in names or module == "moto.server":
        return "S3"
    if module == "torch.distributed.run" or "torchrun" in names:
        return "torchrun"
    return None


@dataclass
class Start:
    kind: str
    pid: int | None
    test: str | None  # the test running when it was seen (None: between tests)


@dataclass
class Census:
    starts: list[Start] = field(default_factory=list)
    current: str | None = None
    _seen: set[tuple[int, float]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def record(self, kind: str, proc: psutil.Process | None = None) -> None:
        with self._lock:
            if proc is not None:
                try:
                    key = (proc.pid, proc.create_time())
                except psutil.Error:
                    return
                if key in self._seen:
                    return
                self._seen.add(key)
            self.starts.append(Start(kind, proc.pid if proc else None, self.current))

    def look(self) -> None:
        for child, kind in _servers_now(skip=self._seen):
            self.record(kind, child)

    def run(self) -> None:
        while not self._stop.wait(CENSUS_INTERVAL_S):
            self.look()

    def during(self, test: str) -> list[Start]:
        with self._lock:
            return [s for s in self.starts if s.test == test]

    def live_vllm_servers(self) -> list[psutil.Process]:
        """vLLM api_servers among this process's descendants now."""
        return [child for child, kind in _servers_now() if kind == "vLLM"]


def _servers_now(skip: set[tuple[int, float]] = frozenset()) -> list[tuple[psutil.Process, str]]:
    """(process, kind) of each server among this process's live descendants, but those in `skip`
    (pid, start time)."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            if (child.pid, child.create_time()) in skip:
                continue
            kind = server_kind(child.cmdline())
        except psutil.Error:
            continue
        if kind:
            found.append((child, kind))
    return found


CENSUS = Census()


def _watch_popen() -> None:
    original = subprocess.Popen.__init__

    def init(self, args, *a, **kw):
        original(self, args, *a, **kw)
        argv = args if isinstance(args, list | tuple) else str(args).split()
        kind = server_kind(list(argv))
        if kind:
            try:
                CENSUS.record(kind, psutil.Process(self.pid))
            except psutil.Error:
                CENSUS.record(kind)

    subprocess.Popen.__init__ = init


def _watch_moto() -> None:
    from moto.server import ThreadedMotoServer

    original = ThreadedMotoServer.start

    def start(self):
        CENSUS.record("S3")
        return original(self)

    ThreadedMotoServer.start = start


def pytest_addoption(parser):
    parser.addoption(
        "--suite-report", default=None, help="write durations, markers and server starts as JSON here"
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "own_server: the test kills or breaks its vLLM server, or launches its own: the pool's is stopped first",
    )
    config.addinivalue_line("markers", "slow_ok(reason): a test allowed over the 120 s budget, and why")
    _watch_popen()
    _watch_moto()
    threading.Thread(target=CENSUS.run, name="server-census", daemon=True).start()
    config._suite_durations = {}


def pytest_unconfigure(config):
    CENSUS._stop.set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    CENSUS.current = item.nodeid
    yield
    CENSUS.look()  # a server still starting when the test ended belongs to it
    CENSUS.current = None


# Fixtures that start (or hand out) a vLLM, Prefect or S3 server. A fast test asking for one, even
# through another fixture, is refused before it runs: the census alone would blame whichever fast
# test happened to start a session-scoped server first, and pass the ones after it.
SERVER_FIXTURES = frozenset({"vllm_servers", "s3", "prefect_harness", "prefect_server"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        wanted = SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if wanted and not item.get_closest_marker("slow"):
            item._server_fixtures = ", ".join(sorted(wanted))


@pytest.hookimpl(tryfirst=True)  # before any fixture is set up
def pytest_runtest_setup(item):
    names = getattr(item, "_server_fixtures", None)
    if names:
        pytest.fail(
            f"this test is not marked slow but asks for a server fixture ({names}). Tests in "
            "`make test-fast` start no vLLM, Prefect or S3 server: mark it `@pytest.mark.slow`.",
            pytrace=False,
        )


def _violations(item) -> list[Start]:
    if item.get_closest_marker("slow"):
        return []
    return CENSUS.during(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    entry = item.config._suite_durations.setdefault(item.nodeid, {"setup": 0.0, "call": 0.0, "teardown": 0.0})
    entry[report.when] = report.duration
    if report.when == "teardown":
        CENSUS.look()
    if report.when == "call" and not report.failed and not item.get_closest_marker("slow"):
        # A server fixture asked for at run time (request.getfixturevalue), which collection cannot see.
        asked = SERVER_FIXTURES.intersection(getattr(getattr(item, "_request", None), "_fixture_defs", {}))
        if asked:
            report.outcome = "failed"
            report.longrepr = (
                f"this test is not marked slow but asked for a server fixture at run time "
                f"({', '.join(sorted(asked))}): mark it (or that parameter) `@pytest.mark.slow`."
            )
            return
    started = _violations(item)
    reported = getattr(item, "_servers_reported", 0)
    if report.when in ("call", "teardown") and len(started) > reported and not report.failed:
        item._servers_reported = len(started)
        kinds = ", ".join(sorted({s.kind for s in started}))
        report.outcome = "failed"
        report.longrepr = (
            f"this test is not marked slow but started: {kinds}. Tests in `make test-fast` start no "
            "vLLM, Prefect or S3 server and no torchrun; mark it `@pytest.mark.slow` or keep it off servers."
        )


def pytest_terminal_summary(terminalreporter, config):
    counts = Counter(s.kind for s in CENSUS.starts)
    if counts:
        shown = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
        terminalreporter.write_line(f"server start-ups in this run: {shown}")


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--suite-report")
    if not path:
        return
    items = {item.nodeid: item for item in session.items}
    tests = []
    for nodeid, phases in session.config._suite_durations.items():
        item = items.get(nodeid)
        slow_ok = item.get_closest_marker("slow_ok") if item else None
        tests.append(
            {
                "nodeid": nodeid,
                "seconds": round(sum(phases.values()), 3),
                **{k: round(v, 3) for k, v in phases.items()},
                "slow": bool(item and item.get_closest_marker("slow")),
                "slow_ok": (slow_ok.kwargs.get("reason") or (slow_ok.args[0] if slow_ok.args else ""))
                if slow_ok
                else None,
                "servers": [s.kind for s in CENSUS.starts if s.test == nodeid],
            }
        )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "finished": time.time(),
        "server_startups": dict(Counter(s.kind for s in CENSUS.starts)),
        "tests": tests,
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)
