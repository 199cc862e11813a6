"""vLLM servers launched by `draftflow extract` never outlive their run, and a run survives its server.

The CLI launches the real SmolLM2 server itself (recipe `vllm.launch`, CPU). Every process of
these runs (CLI, watchdog, vLLM and its engine) carries this test's own DRAFTFLOW_HOME in its
environment, which is how the test finds them in /proc, whatever their parents became.
Each CLI run costs one vLLM start (~30-60 s on a 2-core host), so there are few of them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from extraction_helpers import launch_recipe_dict
from fault_series import kills, report
from test_kill9_real import assert_nothing_partial

from draftflow.data.prepare import prepare_recipe
from draftflow.extraction import expected_samples
from draftflow.plan import Plan
from draftflow.store import Store, read_manifest, verify
from draftflow.vllm.launch import free_port

pytestmark = pytest.mark.slow

DRAFTFLOW = Path(sys.executable).with_name("draftflow")
KILLS = kills(5)


def processes_of(home: Path) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) process started under DRAFTFLOW_HOME=home."""
    marker = f"DRAFTFLOW_HOME={home}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if marker not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def wait_until_gone(home: Path, timeout_s: float = 40.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def launch_run(vllm_servers, vllm_python: str, smollm2_dir: Path, tmp_path: Path):
    """A recipe whose CLI run launches its own server on a fixed port, and a way to start the CLI."""
    vllm_servers.stop()  # one vLLM at a time on this host
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    staging = tmp_path / "staging"
    recipe = launch_recipe_dict(
        smollm2_dir,
        str(tmp_path / "store"),
        port,
        staging,
        vllm_python,
        sources=[{"kind": "chatterbot", "max_samples": 400}],
        num_samples=100,
        eval_samples=4,
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    plan = Plan.load(str(path))
    prepare_recipe(plan.recipe, plan.data)
    env = {**os.environ, "DRAFTFLOW_HOME": str(home), "PYTHONUNBUFFERED": "1"}

    def start(log_name: str) -> subprocess.Popen:
        log = open(tmp_path / log_name, "w")
        return subprocess.Popen(
            [str(DRAFTFLOW), "extract", str(path)], stdout=log, stderr=subprocess.STDOUT, env=env
        )

    run = type("LaunchRun", (), {})()
    run.plan, run.home, run.port, run.start, run.dir = plan, home, port, start, tmp_path
    run.expected = [e.sample_id for e in expected_samples(plan)]
    yield run
    for pid in processes_of(home):  # never leave anything behind, whatever failed
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the CLI exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def records(home: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (home / "run" / "vllm-servers").glob("*.json")]


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_killed_cli_leaves_no_server_and_the_data_intact(launch_run):
    """kill -9 of the CLI at random instants (server start-up or extraction; the suite's one kill
    lands during extraction, bench/faults.py runs the series of 5): the server it launched goes with it, and a final run completes the store with every sample exactly once."""
    run = launch_run
    rng = random.Random(int(os.environ.get("DRAFTFLOW_CRASH_SEED", "12")))
    store = Store(run.plan.data)
    landed = {"start-up": 0, "extraction": 0}
    for trial in range(KILLS):
        log = run.dir / f"kill-{trial}.log"
        proc = run.start(log.name)
        if trial % 2 or KILLS == 1:  # during extraction: a random instant after the first shards went out
            wait_for(lambda log=log: "extract:" in log.read_text(), 900, "extraction", proc)
            time.sleep(rng.uniform(0, 6))
        else:  # anywhere from the lock and the launch (~15 s) to the first requests
            time.sleep(rng.uniform(3, 20))
        landed["extraction" if "extract:" in log.read_text() else "start-up"] += 1
        proc.kill()
        proc.wait()
        # The watchdog stops the server, one killed during start-up too, before its 20 s grace is
        # out: that API server waits forever for an engine that has gone, and used to be killed
        # only then (21 s); now 3 s after the engine (draftflow.vllm.engine_exit), which itself
        # may take ~8 s to shut down its half-started worker (5-12 s in all, measured).
        left = wait_until_gone(run.home, timeout_s=18)
        assert left == {}, f"trial {trial}: processes outlived the killed CLI by 18 s: {left}"
        assert_nothing_partial(store, set(run.expected))
    final = run.start("final.log")
    assert final.wait(timeout=900) == 0, (run.dir / "final.log").read_text()[-3000:]
    ids = read_manifest(store)["sample_id"].to_pylist()
    assert ids == run.expected and len(set(ids)) == len(ids)  # nothing lost, nothing twice
    assert verify(store).ok  # nothing corrupt
    assert wait_until_gone(run.home) == {} and records(run.home) == []
    report(
        "kill -9 of the CLI with its launched server (tests/extraction/test_vllm_lifecycle_real.py)",
        KILLS,
        f"{landed}, {len(ids)}/{len(run.expected)} samples, 0 lost, 0 duplicated, 0 corrupt, no server left",
    )


@pytest.mark.slow_ok(reason="three vLLM start-ups: the orphan, its replacement, the restart after a kill")
def test_orphan_is_stopped_not_adopted_and_a_server_killed_mid_run_is_restarted(launch_run):
    run = launch_run
    # 1. An orphan: freeze the watchdog (so it cannot act on its launcher's death), kill the CLI.
    first = run.start("orphan.log")
    wait_for(lambda: healthy(run.port), 600, "the first server", first)
    [record] = records(run.home)
    os.kill(record["pgid"], signal.SIGSTOP)
    first.kill()
    first.wait()
    time.sleep(2)
    orphans = processes_of(run.home)
    assert any("vllm.entrypoints" in cmd for cmd in orphans.values()), "no orphan to test with"

    # 2. The next run stops that orphan instead of adopting it, launches its own on the port...
    second = run.start("second.log")
    wait_for(lambda: not set(orphans) & set(processes_of(run.home)), 120, "the orphan to be stopped", second)
    new = wait_for(
        lambda: [r for r in records(run.home) if r["pgid"] != record["pgid"]], 600, "a new launch", second
    )
    # 3. ...and when that server is killed mid-run, it starts it again and finishes the shards.
    wait_for(lambda: "extract:" in (run.dir / "second.log").read_text(), 600, "extraction", second)
    time.sleep(2)
    server = [
        pid
        for pid, cmd in processes_of(run.home).items()
        if "vllm.entrypoints" in cmd and os.getpgid(pid) == new[0]["pgid"]
    ]
    assert server, processes_of(run.home)
    os.kill(server[0], signal.SIGKILL)
    assert second.wait(timeout=900) == 0, (run.dir / "second.log").read_text()[-3000:]
    log = (run.dir / "second.log").read_text()
    assert "left running by a killed draftflow run" in log
    assert "starting it again" in log
    store = Store(run.plan.data)
    ids = read_manifest(store)["sample_id"].to_pylist()
    assert ids == run.expected and verify(store).ok
    assert wait_until_gone(run.home) == {} and records(run.home) == []
