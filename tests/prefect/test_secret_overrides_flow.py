"""A deployment made with secret `--set` overrides (a launch env value, an `--api-key` in extra_args)
runs the train flow on a real process worker against a real Prefect server: the secrets reach the
trainer (through its environment), and appear nowhere else — not in the deployment's or the flow
run's parameters, a log, an artifact, a task run, the worker's output, the run folder or the export,
nor on the command line of any process while the training runs."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect_helpers import PREFECT, flow_run_logs, stop_group, train_fixtures, trigger, wait_final
from test_blocks_secrets import local_bytes, planted

from draftflow.plan import Plan
from flows.cli import main as cli_main

pytestmark = pytest.mark.slow


class ProcWatch:
    """While it runs: every process whose command line holds one of `secrets`, and the command line
    and environment of every process that mentions `needle` (torchrun and its workers)."""

    def __init__(self, needle: str, secrets: list[str]):
        self.needle, self.secrets = needle.encode(), [s.encode() for s in secrets]
        self.leaked: dict[int, bytes] = {}
        self.trainers: dict[int, tuple[bytes, bytes]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    argv = (entry / "cmdline").read_bytes()
                    if any(s in argv for s in self.secrets):
                        self.leaked.setdefault(int(entry.name), argv)
                    if self.needle in argv and int(entry.name) not in self.trainers:
                        self.trainers[int(entry.name)] = (argv, (entry / "environ").read_bytes())
                except OSError:
                    continue
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_secret_overrides_of_a_deployment_reach_the_trainer_and_nothing_else(
    prefect_server, start_process, smollm2_dir: Path, tmp_path: Path
):
    from prefect.client.orchestration import get_client

    fixtures = train_fixtures()
    recipe = str(
        fixtures.write_recipe(
            tmp_path,
            data={
                "sources": [{"kind": "chatterbot", "max_samples": 16}],
                "eval_samples": 4,
                "max_length": 64,
            },
            drafter={"draft_vocab_size": 512, "max_anchors": 8},
            training={"pack_length": 128},
        )
    )
    fixtures.fill_store(Plan.load(recipe), smollm2_dir)
    secrets = {"hub token": planted("hf-token"), "api key": planted("api-key")}
    overrides = [
        "vllm.launch.device=cpu",
        f"vllm.launch.env.HF_TOKEN={secrets['hub token']}",
        f"vllm.launch.extra_args=[--api-key, {secrets['api key']}]",
        "training.epochs=1",
    ]
    pool, name = f"pool-{uuid.uuid4().hex[:6]}", f"secret-train-{uuid.uuid4().hex[:6]}"
    sets = [a for o in overrides for a in ("--set", o)]
    argv = ["deploy", recipe, "--flow", "train", "--name", name, "--pool", pool, "--run-id", "secret"]
    assert cli_main(argv + sets) == 0
    worker = start_process(
        [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--limit", "1"],
        env={"OMP_NUM_THREADS": "1"},
    )
    watch = ProcWatch(recipe, list(secrets.values()))
    try:
        run = wait_final(trigger(f"draftflow-train/{name}"), timeout_s=400)
    finally:
        watch.stop()
    assert run.state.type.value == "COMPLETED", worker.output()[-3000:]
    stop_group(worker.proc)  # everything it and its flow run wrote is flushed

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"draftflow-train/{name}")
        api_records = {
            "flow run logs": "\n".join(flow_run_logs(run.id)),
            "flow runs": "\n".join(r.model_dump_json() for r in client.read_flow_runs(limit=200)),
            "task runs": "\n".join(t.model_dump_json() for t in client.read_task_runs(limit=200)),
            "deployments": "\n".join(d.model_dump_json() for d in client.read_deployments(limit=200)),
            "artifacts": "\n".join(a.model_dump_json() for a in client.read_artifacts(limit=200)),
        }
    files = local_bytes(tmp_path / "runs", worker.log, prefect_server.log)
    shown = {f"argv of pid {pid}": argv for pid, argv in watch.leaked.items()}
    leaks = [
        f"{what} in {where}"
        for what, secret in secrets.items()
        for where, text in [*api_records.items(), *files.items(), *shown.items()]
        if secret.encode() in (text if isinstance(text, bytes) else text.encode())
    ]
    assert leaks == [], "\n".join(leaks)

    assert deployment.parameters["overrides"] == [
        "vllm.launch.device=cpu",
        "vllm.launch.env.HF_TOKEN=**********",
        "vllm.launch.extra_args=**********",
        "training.epochs=1",
    ]
    assert (
        "training: " in api_records["flow run logs"] and "HF_TOKEN=**********" in api_records["flow run logs"]
    )
    # torchrun and its worker ran and got the secrets, in their environment only
    assert sum(b"torch.distributed.run" in a for a, _ in watch.trainers.values()) == 1
    assert sum(b"draftflow.train" in a for a, _ in watch.trainers.values()) >= 2
    for _, environ in watch.trainers.values():
        assert all(s.encode() in environ for s in secrets.values())
    exported = [p.read_text() for p in (tmp_path / "runs").rglob("recipe.yaml")]
    assert exported and all("HF_TOKEN: '**********'" in text for text in exported)
