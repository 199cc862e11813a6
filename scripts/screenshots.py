"""Screenshots of the Prefect UI over a real demo run, for the operations page (run by hand).

    .venv/bin/python scripts/screenshots.py [--out docs/images] [--work /tmp/draftflow-screenshots]

What it does, as a user would: starts a Prefect server of its own (its own PREFECT_HOME and port),
`draftflow deploy`s the demo recipe (on demand, with the store, runs and releases under --work),
starts `prefect worker start --pool draftflow-process`, runs the deployment, and lets one
extraction shard fail on its first attempt (the extraction fault hook the tests use,
``DRAFTFLOW_TEST_FAIL_SHARDS`` with a fail-once folder). It then presses the UI's Retry (the
same request), waits for the pipeline to finish, and photographs with headless Chromium (Debian's
``chromium`` package: ``apt-get install chromium``): the failed flow run, the same run retried and
completed, its shard table and its acceptance report; and it copies the acceptance and training
charts the run drew. Wall time: the demo's, about 15 min on a
2-core CPU. It stops the server and the worker it started (the flow run stops the vLLM server it
launched, as every run does); --work is left for inspection and removed by the next run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RECIPE = "recipes/smollm2-135m-dflash-cpu-demo.yaml"
NAME = "smollm2-135m-dflash-cpu-demo"
DEPLOYMENT = "docs-screenshots"
FAILING_SHARD = "000003"
RETRY_STATE = {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
MARKER = ".draftflow-screenshots"  # in --work: the folder is this script's to remove
CHROMIUM_FLAGS = [  # headless on a closed network: no background connections, no sandbox as root
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process in its own group, so stopping it stops what it started (the worker's flow runs)."""
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_healthy(api: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the Prefect server exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"the Prefect server did not answer in {timeout_s:.0f} s")


def flow_run(api: str, run_id: str) -> dict:
    return httpx.get(f"{api}/flow_runs/{run_id}", timeout=30).json()


def wait_final(api: str, run_id: str, worker: subprocess.Popen, after_run_count: int = 0) -> dict:
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        run = flow_run(api, run_id)
        if run["state"]["type"] in FINAL and run["run_count"] > after_run_count:
            return run
        if worker.poll() is not None:
            sys.exit("the worker exited; see its log under --work")
        time.sleep(5)
    sys.exit(f"flow run {run_id} did not finish in an hour")


def artifact_id(api: str, run_id: str, key: str) -> str:
    body = {"artifacts": {"flow_run_id": {"any_": [run_id]}, "key": {"any_": [key]}}, "limit": 1}
    found = httpx.post(f"{api}/artifacts/filter", json=body, timeout=30).json()
    if not found:
        sys.exit(f"flow run {run_id} has no artifact {key!r}")
    return found[0]["id"]


def shoot(chromium: str, url: str, out: Path, work: Path, height: int = 900) -> None:
    """The page once its scripts have fetched and drawn (virtual time runs them to idle)."""
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={work / 'chromium'}", f"--window-size=1440,{height}"]
    cmd += ["--virtual-time-budget=20000", f"--screenshot={out}", url]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--work", type=Path, default=Path("/tmp/draftflow-screenshots"))
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("no chromium on PATH: apt-get install chromium")
    if args.work.is_symlink():
        sys.exit(f"--work {args.work} is a symbolic link: give a folder of its own")
    work = args.work.resolve()
    if work.exists():  # remove only what this script made last time (store, runs, Prefect home)
        if not (work / MARKER).is_file() and any(work.iterdir()):
            sys.exit(f"--work {work} holds files this script did not write: give an empty or new folder")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / MARKER).write_text("made by scripts/screenshots.py; removed by its next run\n")
    args.out.mkdir(parents=True, exist_ok=True)

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(work / "prefect"), PREFECT_API_URL=api)
    env |= {"PREFECT_UI_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    started: list[subprocess.Popen] = []
    try:
        server = start(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env,
            work / "server.log",
        )
        started.append(server)
        wait_healthy(api, server, work / "server.log")
        overrides = [
            f"extraction.store={work / 'store'}",
            f"training.run_dir={work / 'runs'}",
            f"publish.destination={work / 'published'}",
        ]
        deploy = [str(BIN / "draftflow"), "deploy", RECIPE, "--name", DEPLOYMENT]
        for o in overrides:
            deploy += ["--set", o]
        subprocess.run(deploy, env=env, cwd=ROOT, check=True)
        fault_env = env | {
            "DRAFTFLOW_TEST_FAIL_SHARDS": FAILING_SHARD,
            "DRAFTFLOW_TEST_FAIL_ONCE_DIR": str(work / "once"),
        }
        worker = start(
            [str(BIN / "prefect"), "worker", "start", "--pool", "draftflow-process"],
            fault_env,
            work / "worker.log",
        )
        started.append(worker)
        deployment = httpx.get(f"{api}/deployments/name/draftflow-pipeline/{DEPLOYMENT}", timeout=30).json()
        made = httpx.post(f"{api}/deployments/{deployment['id']}/create_flow_run", json={}, timeout=30)
        run_id = made.raise_for_status().json()["id"]  # what the UI's Run button asks
        print(f"flow run {run_id}: http://127.0.0.1:{port}/runs/flow-run/{run_id}")

        first = wait_final(api, run_id, worker)
        if first["state"]["type"] != "FAILED":
            sys.exit(f"expected the first attempt to fail on shard {FAILING_SHARD}, got {first['state']}")
        print(f"first attempt: {first['state']['message']}")
        shoot(
            chromium,
            f"http://127.0.0.1:{port}/runs/flow-run/{run_id}",
            args.out / "prefect-run-failed.png",
            work,
        )

        answer = (
            httpx.post(
                f"{api}/flow_runs/{run_id}/set_state", json={"state": RETRY_STATE, "force": True}, timeout=30
            )
            .raise_for_status()
            .json()
        )
        if answer.get("status") != "ACCEPT":
            sys.exit(f"the server did not accept Retry: {answer}")
        again = wait_final(api, run_id, worker, after_run_count=first["run_count"])
        if again["state"]["type"] != "COMPLETED":
            sys.exit(f"the retry ended {again['state']}; see {work / 'worker.log'}")
        print(f"retry: {again['state']['type']} (run {again['run_count']})")
        shoot(
            chromium,
            f"http://127.0.0.1:{port}/runs/flow-run/{run_id}",
            args.out / "prefect-run-retried.png",
            work,
        )
        for what, picture in (
            ("shards", "prefect-shard-table.png"),
            ("acceptance", "prefect-acceptance.png"),
        ):
            found = artifact_id(api, run_id, f"{NAME}-{what}")
            shoot(
                chromium,
                f"http://127.0.0.1:{port}/artifacts/artifact/{found}",
                args.out / picture,
                work,
                1100,
            )
        for chart, picture in (
            ("eval/acceptance.png", "demo-acceptance.png"),
            ("training_curves.png", "demo-training-curves.png"),
        ):
            drawn = sorted((work / "runs").rglob(chart), key=lambda p: p.stat().st_mtime)
            if not drawn:
                sys.exit(f"the run drew no {chart} under {work / 'runs'}")
            shutil.copyfile(drawn[-1], args.out / picture)  # the charts the pipeline draws, as drawn
            print(f"copied {drawn[-1]} -> {args.out / picture}")
    finally:
        for proc in reversed(started):
            stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
