"""Two draftflow runs on one host, one endpoint port: the second never talks to the first's server.

Run A (`draftflow extract`) launches the real SmolLM2 server on a fixed port. Run B, the same
recipe with its own store and its own ``DRAFTFLOW_HOME`` (so no record file is shared), is
started while A's server answers there: it fails within seconds, naming the port and run A,
instead of sending its requests (or its text generation) to a server with another run's
settings. Run A is untouched: it is still extracting, its server answering, and what it committed
verifies once it is stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from extraction_helpers import launch_recipe_dict
from test_vllm_lifecycle_real import DRAFTFLOW, healthy, processes_of, wait_for, wait_until_gone

from draftflow.data.prepare import prepare_recipe
from draftflow.plan import Plan
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.store import Store, read_manifest, verify
from draftflow.vllm.adopted import PortHeldByAnotherRun
from draftflow.vllm.launch import free_port
from draftflow.vllm.plain_server import ensure_plain_running

pytestmark = pytest.mark.slow


def committed(store: Store) -> int:
    try:
        return len(read_manifest(store))
    except FileNotFoundError:
        return 0


def test_a_second_run_on_the_same_port_fails_at_once_naming_the_first(
    vllm_servers, vllm_python: str, smollm2_dir: Path, tmp_path: Path
):
    vllm_servers.stop()  # one vLLM at a time on this host
    port = free_port()
    staging = tmp_path / "staging"

    def prepared(name: str) -> Path:
        (tmp_path / f"home-{name}").mkdir()
        recipe = launch_recipe_dict(
            smollm2_dir,
            str(tmp_path / f"store-{name}"),
            port,
            staging,
            vllm_python,
            sources=[{"kind": "chatterbot", "max_samples": 600}],
            num_samples=400,  # A is still extracting when B starts
            eval_samples=4,
        )
        path = tmp_path / f"recipe-{name}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        plan = Plan.load(str(path))
        prepare_recipe(plan.recipe, plan.data)
        return path

    def run(name: str) -> tuple[subprocess.Popen, Path, Path]:
        home, log = tmp_path / f"home-{name}", tmp_path / f"{name}.log"
        env = {**os.environ, "DRAFTFLOW_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [str(DRAFTFLOW), "extract", str(recipes[name])],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        return proc, log, home

    recipes = {name: prepared(name) for name in ("a", "b")}
    first, first_log, first_home = run("a")
    try:
        wait_for(lambda: healthy(port), 600, "run A's server", first)
        second, second_log, _ = run("b")
        started = time.monotonic()
        assert second.wait(timeout=120) != 0
        took = time.monotonic() - started
        said = second_log.read_text()
        assert f"port {port} on this host is held by a vLLM server another draftflow run started" in said, (
            said
        )
        assert f"pid {first.pid}" in said, said  # names run A
        assert took < 60, f"the second run took {took:.0f}s to fail"
        # The same from this process, on the generation path (a plain server is wanted there).
        launch = VLLMLaunchSection(python=vllm_python, device="cpu", max_model_len=1024)
        with pytest.raises(PortHeldByAnotherRun, match=f"port {port}"):
            ensure_plain_running(f"http://127.0.0.1:{port}", model=str(smollm2_dir), launch=launch)
        # Run A is untouched: still extracting, its server still answering. It is then stopped as
        # a user would (SIGTERM); extracting its 400 samples to the end proves nothing more here.
        assert first.poll() is None and healthy(port), first_log.read_text()[-3000:]
        store = Store(Plan.load(str(recipes["a"])).data)
        wait_for(lambda: committed(store), 600, "run A's first shard", first)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    finally:
        for proc in (first,):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert committed(store) and verify(store).ok  # A committed shards; none torn
    assert wait_until_gone(first_home) == {} and processes_of(tmp_path / "home-b") == {}
