"""Planted secrets (S3 key id and secret and a vLLM API key from Prefect blocks, a Hub token in the
operator's environment) used by real train flow runs, hybrid and offline, on a real Prefect
server with the store on loopback S3 and a real vLLM that enforces the API key: none of them
appears on the command line of any child process (vLLM, its watchdog and engine, torchrun and
its workers, read from /proc while they run), in the run folder or the exported drafter, in a
log, artifact, run record or result, in the bucket, or in the message of a flow run that failed.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import yaml
from prefect_helpers import flow_run_logs, stop_group, trigger, wait_final
from test_blocks_secrets import decoded_result, local_bytes, planted, read_everything

from blocks.infrastructure import HiddenStateStore, VLLMServer
from draftflow.data.prepare import prepare_recipe
from draftflow.plan import Plan
from draftflow.process_group import live_members
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.store import Store, read_manifest
from draftflow.vllm.launch import free_port
from draftflow.vllm.server import ensure_running

pytestmark = pytest.mark.slow


class ArgvWatch:
    """Every command line seen, while it runs, of the processes that mention `needle` (torchrun and
    its workers carry the recipe path) or belong to one of `groups` (a launched vLLM)."""

    def __init__(self, needle: str, groups: list[int]):
        self.needle, self.groups = needle.encode(), groups
        self.seen: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            members = {pid for g in self.groups for pid in live_members(g)}
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    argv = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if self.needle in argv or int(entry.name) in members:
                    self.seen.setdefault(int(entry.name), argv)
            time.sleep(0.2)

    def stop(self) -> dict[int, bytes]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.seen


@pytest.mark.slow_ok(
    reason="three train flow runs on a Prefect server: hybrid through a keyed vLLM, offline, a failing one"
)
def test_planted_secrets_never_leak_from_train_and_hybrid_flows(
    prefect_server,
    start_runner,
    vllm_servers,
    vllm_python: str,
    s3,
    smollm2_dir: Path,
    tmp_path: Path,
    monkeypatch,
):
    from prefect.client.orchestration import get_client

    secrets = {
        "s3 key id": planted("AKID"),
        "s3 secret": planted("s3-secret"),
        "vllm api key": planted("vllm-key"),
        "hub token": planted("hf-token"),
    }
    # The operator's environment: the Hub token reaches vLLM (and the runner) as HF_TOKEN.
    monkeypatch.setenv("HF_TOKEN", secrets["hub token"])
    client_kwargs = s3["storage_options"]["client_kwargs"]
    options = {"key": secrets["s3 key id"], "secret": secrets["s3 secret"], "client_kwargs": client_kwargs}
    prefix = f"secrets-train-{uuid.uuid4().hex[:8]}"
    store_url = f"{s3['url']}/{prefix}/store"
    staging = tmp_path / "staging"
    recipe = {
        "name": "prefect-secrets-train",
        "target": {"model": str(smollm2_dir)},
        "data": {"sources": [{"kind": "chatterbot", "max_samples": 24}], "eval_samples": 4, "max_length": 64},
        "extraction": {"dtype": "float32", "samples_per_shard": 8, "store": store_url},
        "vllm": {"endpoints": ["http://127.0.0.1:9"], "staging_dirs": [str(staging)]},  # the block's wins
        "drafter": {
            "kind": "dflash",
            "block_size": 4,
            "max_anchors": 8,
            "num_layers": 1,
            "draft_vocab_size": 512,
        },
        "training": {
            "epochs": 1,
            "lr": 1e-3,
            "pack_length": 128,
            "device": "cpu",
            "log_every": 1,
            "warmup_ratio": 0.0,
            "run_dir": str(tmp_path / "runs"),
        },
    }
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    plan = Plan.load(str(recipe_path), storage_options=options)
    prepare_recipe(plan.recipe, plan.data, storage_options=options)

    # vLLM launched by draftflow with the planted key (which it then enforces) and the token in its env
    vllm_servers.stop()
    handle = ensure_running(
        f"http://127.0.0.1:{free_port()}",
        model=plan.target_model,
        layer_ids=plan.layer_ids,
        hidden_size=plan.target.hidden_size,
        api_key=secrets["vllm api key"],
        launch=VLLMLaunchSection(
            python=vllm_python,
            device="cpu",
            max_model_len=512,
            staging_dir=str(staging),
            startup_timeout_s=300,
        ),
        log_dir=tmp_path / "vllm-logs",
    )
    names = {k: f"{k}-{uuid.uuid4().hex[:8]}" for k in ("store", "vllm", "dead-store")}
    HiddenStateStore(
        url=store_url,
        storage_options={"client_kwargs": client_kwargs},
        access_key_id=secrets["s3 key id"],
        secret_access_key=secrets["s3 secret"],
    ).save(names["store"])
    VLLMServer(endpoints=handle.endpoints, api_key=secrets["vllm api key"]).save(names["vllm"])
    HiddenStateStore(  # an S3 endpoint that is down: the flow run fails, and says why
        url=store_url,
        storage_options={"client_kwargs": {**client_kwargs, "endpoint_url": "http://127.0.0.1:9"}},
        access_key_id=secrets["s3 key id"],
        secret_access_key=secrets["s3 secret"],
    ).save(names["dead-store"])
    common = {"recipe": str(recipe_path), "store_block": names["store"]}
    runner = start_runner(
        [
            {
                "flow": "flows.stages:train",
                "name": "secrets-hybrid",
                "parameters": {
                    **common,
                    "overrides": ["extraction.mode=hybrid"],
                    "vllm_block": names["vllm"],
                    "run_id": "hybrid",
                },
            },
            {
                "flow": "flows.stages:train",
                "name": "secrets-offline",
                "parameters": {**common, "run_id": "offline"},
            },
            {
                "flow": "flows.stages:train",
                "name": "secrets-dead-store",
                "parameters": {
                    "recipe": str(recipe_path),
                    "store_block": names["dead-store"],
                    "run_id": "dead",
                },
            },
        ],
        env={"OMP_NUM_THREADS": "1", "HF_TOKEN": secrets["hub token"]},
    )
    watch = ArgvWatch(str(recipe_path), [p.pid for p in handle.started])
    runs = []
    try:
        for deployment in runner.deployment_names:
            runs.append(wait_final(trigger(deployment), timeout_s=600))
    finally:
        argv = watch.stop()
        vllm_log = handle.started[0].spec.log_path
        handle.stop()
    hybrid, offline, dead = runs
    assert hybrid.state.type.value == "COMPLETED", runner.output()[-3000:]
    assert offline.state.type.value == "COMPLETED", runner.output()[-3000:]
    assert dead.state.type.value == "FAILED", runner.output()[-3000:]

    # the flows really used the blocks: the hybrid run extracted every shard through the keyed vLLM
    store = Store(plan.data, options)
    assert set(read_manifest(store)["mode"].to_pylist()) == {"online"}
    assert sum(b"torch.distributed.run" in a for a in argv.values()) >= 2  # torchrun of both runs
    assert sum(b"draftflow.train" in a and b"torch.distributed.run" not in a for a in argv.values()) >= 2
    assert sum(b"vllm.entrypoints" in a for a in argv.values()) >= 1
    exports = sorted((tmp_path / "runs").rglob("recipe.yaml"))
    assert exports, "no exported drafter"

    stop_group(runner.proc)  # everything it and its flow runs wrote is flushed
    with get_client(sync_client=True) as client:
        api_records = {
            "flow run logs": "\n".join(line for r in runs for line in flow_run_logs(r.id)),
            "failed run's message": "\n".join(str(r.state.message) for r in runs),
            "artifacts": "\n".join(a.model_dump_json() for a in client.read_artifacts(limit=200)),
            "flow runs": "\n".join(r.model_dump_json() for r in client.read_flow_runs(limit=200)),
            "task runs": "\n".join(t.model_dump_json() for t in client.read_task_runs(limit=200)),
            "deployments": "\n".join(d.model_dump_json() for d in client.read_deployments(limit=200)),
        }
    assert "secrets-dead-store" in api_records["deployments"]
    assert "127.0.0.1:9" in api_records["failed run's message"] + api_records["flow run logs"]
    shown = {f"argv of pid {pid}": a for pid, a in argv.items()}
    files = local_bytes(tmp_path / "runs", runner.log, runner.results, prefect_server.log, Path(vllm_log))
    files.update({f"{k} (decoded)": decoded_result(v) for k, v in local_bytes(runner.results).items()})
    fs, _ = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    files["s3 bucket"] = read_everything(fs, f"draftflow-test/{prefix}")
    leaks = [
        f"{what} in {where}"
        for what, secret in secrets.items()
        for where, text in [*api_records.items(), *shown.items(), *files.items()]
        if secret.encode() in (text if isinstance(text, bytes) else text.encode())
    ]
    assert leaks == [], "\n".join(leaks)
    assert json.loads(json.dumps(sorted(shown)))  # argv was read for every process seen
