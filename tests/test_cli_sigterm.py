"""A `draftflow pipeline` stopped with SIGTERM leaves nothing running.

With no Prefect server configured, the pipeline starts a temporary (ephemeral) one as its child;
SIGTERM must unwind the command so that server is stopped too, not left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from extraction_helpers import recipe_dict

from draftflow.vllm.launch import free_port

pytestmark = pytest.mark.slow

DRAFTFLOW = Path(sys.executable).with_name("draftflow")


def test_sigterm_to_the_pipeline_stops_its_ephemeral_prefect_server(smollm2_dir: Path, tmp_path: Path):
    # A dead endpoint and no launch settings: the flow runs (and retries) for a while, then fails.
    recipe = recipe_dict(smollm2_dir, str(tmp_path / "store"), f"http://127.0.0.1:{free_port()}")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "DRAFTFLOW_HOME": str(tmp_path / "home")}
    log = open(tmp_path / "pipeline.log", "w")
    cli = subprocess.Popen(
        [str(DRAFTFLOW), "pipeline", str(path)], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    server: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not server and time.monotonic() < deadline and cli.poll() is None:
            server = [
                p
                for p in psutil.Process(cli.pid).children(recursive=True)
                if "uvicorn" in " ".join(p.cmdline())
            ]
            time.sleep(0.2)
        assert server, (tmp_path / "pipeline.log").read_text()[-3000:]
        time.sleep(3)  # the flow is running
        assert cli.poll() is None, (tmp_path / "pipeline.log").read_text()[-3000:]
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) != 0
        gone, alive = psutil.wait_procs(server, timeout=15)
        assert not alive, f"the ephemeral Prefect server outlived the SIGTERM'd pipeline: {alive}"
    finally:
        if cli.poll() is None:
            cli.kill()
        for p in server:  # never leave one behind, whatever failed
            if p.is_running():
                p.kill()
