"""The suite's own promises: `make test-fast` starts no server (the guard in tests/suite_plugin.py
fails a fast test that does), the durations report feeds scripts/suite_budget.py, and the vLLM
pool never starts a second server beside a live one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from suite_plugin import CENSUS, server_kind

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

INNER = """
import subprocess, sys, time
import pytest

def _moto():
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    server.stop()

def test_fast_starts_s3():
    _moto()

@pytest.mark.slow
def test_slow_starts_s3():
    _moto()

def test_fast_starts_torchrun():
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True, check=True)

def test_fast_starts_s3_in_a_grandchild():
    # a real moto server two processes down, alive for 3 s: the census sees it
    code = "import subprocess, sys; subprocess.run([sys.executable, '-m', 'moto.server', '-p', '0'], timeout=3)"
    subprocess.run([sys.executable, "-c", code], capture_output=True)

def test_fast_and_quiet():
    assert sum(range(4)) == 6
"""


@pytest.mark.slow  # its inner session starts real servers, which is what it checks
def test_the_guard_fails_fast_tests_that_start_servers(pytester):
    pytester.makeconftest(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\npytest_plugins = ['suite_plugin']\n"
    )
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_inner=INNER)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--suite-report={report}")
    outcomes = {r["nodeid"].split("::")[1]: r for r in json.loads(report.read_text())["tests"]}
    result.assert_outcomes(passed=2, failed=3)
    failed = {line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("FAILED")}
    assert failed == {
        "test_fast_starts_s3",
        "test_fast_starts_torchrun",
        "test_fast_starts_s3_in_a_grandchild",
    }
    result.stdout.fnmatch_lines(
        ["*not marked slow but started: S3*", "*not marked slow but started: torchrun*"]
    )
    assert outcomes["test_slow_starts_s3"]["servers"] == ["S3"] and outcomes["test_slow_starts_s3"]["slow"]
    assert outcomes["test_fast_and_quiet"]["servers"] == []
    result.stdout.fnmatch_lines(["server start-ups in this run: S3 3, torchrun 1"])


FIXTURES = """
import pytest

@pytest.fixture(scope="session")
def s3():  # stands for the suite's loopback S3 server: the guard goes by the fixture's name
    return {"url": "s3://bucket"}

@pytest.fixture
def uses_s3(s3):
    return s3

def test_fast_asks_for_s3(s3):
    pass

def test_fast_asks_for_s3_through_another_fixture(uses_s3):
    pass

def test_fast_asks_for_s3_at_run_time(request):
    request.getfixturevalue("s3")

@pytest.mark.slow
def test_slow_asks_for_s3(s3):
    pass

@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_backends(backend, request):
    if backend == "s3":
        request.getfixturevalue("s3")
"""


def test_the_guard_fails_fast_tests_that_ask_for_a_server_fixture_in_any_order(pytester):
    """Order-independent: every fast test asking for a server fixture fails, not only the first
    one (which alone would start a session-scoped server)."""
    pytester.makeconftest(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\npytest_plugins = ['suite_plugin']\n"
    )
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_inner=FIXTURES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    failed = {
        line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith(("FAILED", "ERROR"))
    }
    assert failed == {
        "test_fast_asks_for_s3",
        "test_fast_asks_for_s3_through_another_fixture",
        "test_fast_asks_for_s3_at_run_time",
    }
    result.assert_outcomes(passed=3, failed=1, errors=2)  # refused at set-up: an error
    result.stdout.fnmatch_lines(
        ["*asks for a server fixture (s3)*", "*asked for a server fixture at run time (s3)*"]
    )


def test_budget_fails_a_slow_fast_test_and_an_unexplained_long_one(tmp_path):
    def write(name, tests):
        path = tmp_path / name
        path.write_text(json.dumps({"server_startups": {"vLLM": 2}, "tests": tests}))
        return str(path)

    row = {"nodeid": "t.py::a", "seconds": 1.0, "slow": False, "slow_ok": None}
    ok = write(
        "ok.json", [row, {**row, "nodeid": "t.py::b", "seconds": 300.0, "slow": True, "slow_ok": "a series"}]
    )
    bad = write(
        "bad.json",
        [
            {**row, "nodeid": "t.py::c", "seconds": 6.0},
            {**row, "nodeid": "t.py::d", "seconds": 121.0, "slow": True},
        ],
    )
    script = [sys.executable, str(REPO / "scripts" / "suite_budget.py")]
    passed = subprocess.run([*script, ok], capture_output=True, text=True)
    assert passed.returncode == 0, passed.stderr
    assert "300.0 s  slow  t.py::b  [slow_ok: a series]" in passed.stdout and "vLLM 2" in passed.stdout
    failed = subprocess.run([*script, ok, bad], capture_output=True, text=True)
    assert failed.returncode == 1
    assert "t.py::c: 6.0 s without the slow marker" in failed.stderr
    assert "t.py::d: 121.0 s (limit 120 s without @pytest.mark.slow_ok" in failed.stderr
    assert "t.py::a" not in failed.stderr and "t.py::b" not in failed.stderr


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["/h/vllm-venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], "vLLM"),
        (
            [
                "/h/vllm-venv/bin/python",
                "-m",
                "draftflow.vllm.watchdog",
                "--",
                "-m",
                "vllm.entrypoints.openai.api_server",
            ],
            None,
        ),
        (["/v/bin/prefect", "server", "start", "--port", "1"], "Prefect server"),
        (["/v/bin/prefect", "server", "start", "--help"], None),  # usage only: the docs' command check
        (
            ["/v/bin/python", "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"],
            "Prefect server",
        ),
        (["/v/bin/python", "-m", "moto.server", "-p", "0"], "S3"),
        (["/v/bin/torchrun", "--nproc-per-node", "2", "x.py"], "torchrun"),
        (["/v/bin/python", "-m", "pytest", "tests/vllm"], None),
        (["/v/bin/draftflow", "serve", "recipe.yaml"], None),
    ],
)
def test_server_kinds_by_command_line(argv, kind):
    assert server_kind(argv) == kind


@pytest.mark.slow
def test_the_pool_refuses_to_start_beside_a_live_server(vllm_servers, smollm2_dir, vllm_python, tmp_path):
    """A vLLM server this process started outside the pool is still running: the pool says so and
    which test started it, instead of waiting on the host lock."""
    from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port

    vllm_servers.stop()
    startups = vllm_servers.startups
    spec = LaunchSpec(
        python=vllm_python,
        model=str(smollm2_dir),
        port=free_port(),
        device="cpu",
        dtype="float32",
        log_path=str(tmp_path / "vllm.log"),
        max_model_len=256,
        cpu_reserved_cores=0,
    )
    stray = ServerProcess(spec).start()
    try:
        # Starting is enough: the pool must refuse as soon as the stray is a live vLLM process.
        deadline = time.monotonic() + 60
        while not CENSUS.live_vllm_servers() and time.monotonic() < deadline:
            time.sleep(0.5)
        with pytest.raises(pytest.fail.Exception, match="still running before the pool starts one: pid"):
            vllm_servers.get(smollm2_dir)
        assert vllm_servers.current is None and vllm_servers.startups == startups
    finally:
        stray.stop()
    assert not CENSUS.live_vllm_servers()  # the next test's server starts
