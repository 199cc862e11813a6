"""Blocks: registered, saved and loaded through a real Prefect server; secrets are SecretStr; and a
planted secret (S3 key and secret, vLLM API key, Hub token) used by real flow runs appears in no
log, artifact, run record, recipe, store, checkpoint or result file."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import fsspec
import pytest
from prefect_helpers import (
    checkpoint_and_report,
    flow_run_logs,
    stop_group,
    trigger,
    wait_final,
    write_publish_recipe,
    write_tiny_recipe,
)
from pydantic import SecretStr

from blocks.infrastructure import ALL_BLOCKS, CheckpointDestination, HiddenStateStore, VLLMServer
from draftflow.extraction import expected_samples
from draftflow.plan import Plan
from draftflow.store import Store, read_manifest
from flows.cli import main as cli_main


def planted(what: str) -> str:
    return f"planted-{what}-{uuid.uuid4().hex}"


@pytest.mark.slow
def test_blocks_register_save_load_keep_secrets_secret(prefect_server, capsys):
    from prefect.client.orchestration import get_client

    assert cli_main(["blocks", "register"]) == 0
    slugs = [b._block_type_slug for b in ALL_BLOCKS]
    assert capsys.readouterr().out.split() == [w for s in slugs for w in ("registered", "block", "type", s)]
    key, api_key, token = planted("s3-secret"), planted("vllm-key"), planted("hf-token")
    blocks = {
        VLLMServer: VLLMServer(
            endpoints=["http://127.0.0.1:8000", "http://127.0.0.1:8001"],
            api_key=api_key,
            launch={"device": "cpu", "max_model_len": 1024},
        ),
        HiddenStateStore: HiddenStateStore(
            url="s3://bucket/store",
            access_key_id="AKIDPLANT",
            secret_access_key=key,
            storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}},
        ),
        CheckpointDestination: CheckpointDestination(hf_repo_id="org/drafter", hf_token=token),
    }
    with get_client(sync_client=True) as client:
        for cls, block in blocks.items():
            name = f"t-{uuid.uuid4().hex[:8]}"
            block.save(name)
            loaded = cls.load(name)
            assert loaded.model_dump() == block.model_dump()  # SecretStr compare by value
            text = f"{loaded!r} {loaded} {loaded.model_dump_json()}"
            for secret in (key, api_key, token):
                assert secret not in text
            stored = client.read_block_document_by_name(name, cls._block_type_slug, include_secrets=False)
            assert not any(s in json.dumps(stored.data, default=str) for s in (key, api_key, token))
            assert client.read_block_type_by_slug(cls._block_type_slug).name == cls._block_type_name
    vllm, store, dest = (blocks[c] for c in (VLLMServer, HiddenStateStore, CheckpointDestination))
    assert isinstance(vllm.api_key, SecretStr) and vllm.api_key_value() == api_key
    assert vllm.settings().endpoints == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert vllm.settings().launch.max_model_len == 1024
    assert isinstance(store.secret_access_key, SecretStr)
    assert store.settings() == (
        "s3://bucket/store",
        {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "key": "AKIDPLANT", "secret": key},
    )
    assert isinstance(dest.hf_token, SecretStr) and dest.settings()["hf_token"] == token
    with pytest.raises(ValueError, match="exactly one of"):
        CheckpointDestination(url="s3://x", hf_repo_id="org/drafter").settings()


def read_everything(fs, root: str) -> bytes:
    fs.invalidate_cache()
    return b"".join(fs.cat_file(p) for p in fs.find(root))


def local_bytes(*folders: Path) -> dict[str, bytes]:
    return {
        str(p): p.read_bytes()
        for folder in folders
        if folder.exists()
        for p in ([folder] if folder.is_file() else folder.rglob("*"))
        if p.is_file()
    }


def decoded_result(blob: bytes) -> bytes:
    """A Prefect result file holds a base64 pickle, alone or in a JSON record: its decoded bytes."""
    try:
        record = json.loads(blob)
        blob = record["result"].encode() if isinstance(record, dict) and "result" in record else blob
    except ValueError:
        pass
    try:
        return base64.b64decode(blob)
    except ValueError:
        return b""


@pytest.mark.slow
def test_planted_secrets_never_leak(
    prefect_server,
    start_runner,
    extraction_server,
    s3,
    smollm2_dir: Path,
    tiny_llama_dir: Path,
    tmp_path: Path,
    staging_dir: Path,
):
    from prefect.client.orchestration import get_client

    secrets = {
        "s3 key id": planted("AKID"),
        "s3 secret": planted("s3-secret"),
        "vllm api key": planted("vllm-key"),
        "hub token": planted("hf-token"),
        "destination secret": planted("dest-secret"),
    }
    client_kwargs = s3["storage_options"]["client_kwargs"]
    prefix = f"secrets-{uuid.uuid4().hex[:8]}"
    names = {k: f"{k}-{uuid.uuid4().hex[:8]}" for k in ("store", "vllm", "dest")}
    HiddenStateStore(
        url=f"{s3['url']}/{prefix}/store",
        storage_options={"client_kwargs": client_kwargs},
        access_key_id=secrets["s3 key id"],
        secret_access_key=secrets["s3 secret"],
    ).save(names["store"])
    # The test server runs without --api-key and ignores the header; the key still goes through
    # the block, the tasks and every request, which is what must not leak.
    VLLMServer(endpoints=[extraction_server.url], api_key=secrets["vllm api key"]).save(names["vllm"])
    CheckpointDestination(
        url=f"{s3['url']}/{prefix}/published",
        storage_options={"client_kwargs": client_kwargs},
        access_key_id="testing",
        secret_access_key=secrets["destination secret"],
        hf_token=secrets["hub token"],
    ).save(names["dest"])

    recipe = write_tiny_recipe(
        tmp_path / "recipe.yaml",
        smollm2_dir,
        str(tmp_path / "unused-store"),
        "http://127.0.0.1:9",
        name="prefect-secrets",  # endpoints and store: from the blocks
        staging=str(staging_dir),
    )
    publish_recipe = write_publish_recipe(tmp_path / "publish.yaml", tiny_llama_dir)
    checkpoint, report = checkpoint_and_report(tiny_llama_dir, tmp_path / "ckpt", tau=1.5)
    runner = start_runner(
        [
            {
                "flow": "flows.stages:extract",
                "name": "secrets-extract",
                "parameters": {"recipe": recipe, "store_block": names["store"], "vllm_block": names["vllm"]},
            },
            {
                "flow": "flows.stages:publish",
                "name": "secrets-publish",
                "parameters": {
                    "recipe": publish_recipe,
                    "checkpoint_dir": checkpoint,
                    "report": report,
                    "destination_block": names["dest"],
                },
            },
        ]
    )
    runs = []
    for deployment in runner.deployment_names:
        runs.append(wait_final(trigger(deployment)))
        assert runs[-1].state.type.value == "COMPLETED", runner.output()[-3000:]

    # the flows really used the blocks: the store and the checkpoint are in the bucket
    fs, _ = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    plan = Plan.load(recipe, [f"extraction.store={s3['url']}/{prefix}/store"])
    store = Store(plan.data, s3["storage_options"])
    assert read_manifest(store)["sample_id"].to_pylist() == [
        e.sample_id for e in expected_samples(plan, store)
    ]
    assert fs.find(f"draftflow-test/{prefix}/published")
    assert not (tmp_path / "unused-store").exists()

    stop_group(runner.proc)  # everything it and its flow runs wrote is flushed
    with get_client(sync_client=True) as client:
        api_records = {
            "flow run logs": "\n".join(line for r in runs for line in flow_run_logs(r.id)),
            "all logs": "\n".join(log.message for log in client.read_logs(limit=200)),
            "artifacts": "\n".join(a.model_dump_json() for a in client.read_artifacts(limit=200)),
            "flow runs": "\n".join(r.model_dump_json() for r in client.read_flow_runs(limit=200)),
            "task runs": "\n".join(t.model_dump_json() for t in client.read_task_runs(limit=200)),
            "deployments": "\n".join(d.model_dump_json() for d in client.read_deployments(limit=200)),
        }
    # not empty: the shard table, the published link, every shard task
    assert (
        "prefect-secrets-shards" in api_records["artifacts"]
        and "prefect-publish-published" in api_records["artifacts"]
    )
    assert "extract-000004" in api_records["task runs"]
    files = local_bytes(
        tmp_path, runner.log, runner.results, prefect_server.log, Path(extraction_server.spec.log_path)
    )
    files.update(
        {f"{name} (decoded)": decoded_result(blob) for name, blob in local_bytes(runner.results).items()}
    )
    decoded = [blob for name, blob in files.items() if name.endswith("(decoded)")]
    assert any(b"prefect-secrets" in blob for blob in decoded)  # the decoding works (the run reference)
    files["s3 bucket"] = read_everything(fs, f"draftflow-test/{prefix}")
    assert len(files["s3 bucket"]) > 100_000  # shards and weights were read back
    leaks = [
        f"{what} in {where}"
        for what, secret in secrets.items()
        for where, text in [*api_records.items(), *files.items()]
        if secret.encode() in (text if isinstance(text, bytes) else text.encode())
    ]
    assert leaks == []


def test_secrets_stay_out_of_reprs_child_env_argv_exports_and_errors(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch
):
    """No Prefect needed: the core's own objects, the vLLM child's environment and argv, an exported
    drafter folder (recipe.yaml, command.txt, provenance) and error messages."""
    from draftflow.paths import DataLayout
    from draftflow.process_env import STORAGE_OPTIONS_ENV, VLLM_API_KEY_ENV
    from draftflow.recipe.load import RecipeError, parse_override
    from draftflow.train import drafter
    from draftflow.vllm.launch import LaunchSpec, build_command, build_env
    from draftflow.vllm.server import ServerHandle

    secrets = {
        "api key": planted("vllm-key"),
        "s3 secret": planted("s3-secret"),
        "env token": planted("hf-token"),
        "arg token": planted("arg-token"),
        "arg key": planted("arg-key"),
    }
    # reprs (what a traceback, a log line or a Prefect result shows)
    store = Store(DataLayout(str(tmp_path / "store")), {"key": "AKID", "secret": secrets["s3 secret"]})
    handle = ServerHandle(endpoints=["http://127.0.0.1:9"], api_key=secrets["api key"])
    spec = LaunchSpec(
        python="/bin/true",
        model="m",
        port=9,
        device="cpu",
        max_model_len=1024,
        api_key=secrets["api key"],
        env={"HF_TOKEN": secrets["env token"]},
        extra_args=["--hf-token", secrets["arg token"]],
    )
    shown = {
        "Store repr": f"{store!r} {store}",
        "ServerHandle repr": f"{handle!r} {handle}",
        "LaunchSpec repr": f"{spec!r} {spec}",
    }
    # the vLLM child: its environment gets the API key as vLLM's own variable, never the store's credentials
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps({"secret": secrets["s3 secret"]}))
    monkeypatch.setenv(VLLM_API_KEY_ENV, secrets["api key"])
    plain = LaunchSpec(
        python="/bin/true", model="m", port=9, device="cpu", max_model_len=1024, api_key=secrets["api key"]
    )
    env = build_env(plain)
    assert env["VLLM_API_KEY"] == secrets["api key"]  # how vLLM reads it: the environment, not argv
    shown["vLLM child env (besides VLLM_API_KEY)"] = json.dumps(
        {k: v for k, v in env.items() if k != "VLLM_API_KEY"}
    )
    shown["vLLM child argv"] = " ".join(build_command(plain))
    # an exported drafter folder whose recipe launched vLLM with secrets in env and extra_args
    recipe = write_publish_recipe(tmp_path / "publish.yaml", tiny_llama_dir)
    overrides = [
        "vllm.launch.device=cpu",
        f"vllm.launch.env={{HF_TOKEN: {secrets['env token']}}}",
        f"vllm.launch.extra_args=[--api-key, {secrets['arg key']}, --max-num-seqs, '4']",
    ]
    plan = Plan.load(recipe, overrides)
    setup = drafter.build(plan)
    out = drafter.export(setup, plan, tmp_path / "export")
    files = local_bytes(out)
    assert "max-num-seqs" in files[str(out / "recipe.yaml")].decode()  # harmless settings are kept
    assert "HF_TOKEN" in files[str(out / "recipe.yaml")].decode()
    # error messages
    errors = []
    for bad in (
        f"vllm.launch.env.HF_TOKEN=[{secrets['env token']}",
        f"vllm.launch.extra_args=[--hf-token, {{{secrets['arg token']}",
    ):
        with pytest.raises(RecipeError) as info:
            parse_override(bad)
        errors.append(str(info.value))
    shown["error messages"] = "\n".join(errors)
    leaks = [
        f"{what} in {where}"
        for what, secret in secrets.items()
        for where, text in [*shown.items(), *((k, v.decode(errors="replace")) for k, v in files.items())]
        if secret in text
    ]
    assert leaks == [], "\n".join(leaks)
