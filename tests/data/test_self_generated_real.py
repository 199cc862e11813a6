"""Self-generated data against the real vLLM CPU server with SmolLM2 (one plain server for the module).

The preparation goes through the pipeline's own entry point (``prepare_data``), which finds
the healthy plain server and uses it as it is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from draftflow.data.cleaning import estimated_jaccard, minhash, normalise, shingles
from draftflow.data.self_generated import SelfGenerationError
from draftflow.extraction.run import prepare_data
from draftflow.plan import Plan
from draftflow.progress import ProgressSnapshot, reporting
from draftflow.vllm.launch import free_port
from draftflow.vllm.server import is_healthy

REPO = Path(__file__).resolve().parents[2]
LABEL = "0:self_generated"
GENERATION = {
    "num_prompts": 10,
    "topics": ["coding", "math", "trivia", "advice"],
    "max_tokens": 32,
    "temperature": 1.0,
    "max_attempts_ratio": 4,  # a budget of 40 attempts, more than the first batch (32)
}


def write_recipe(folder: Path, model: Path, endpoint: str, **generation) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    recipe = {
        "name": "self-generated-test",
        "target": {"model": str(model)},
        "data": {
            "sources": [{"kind": "self_generated", "self_generated": {**GENERATION, **generation}}],
            "eval_samples": 2,
            "max_length": 256,
            "seed": 5,
            "regenerate_max_tokens": 32,
            "regenerate_concurrency": 8,
        },
        "extraction": {"dtype": "float32", "store": str(folder / "store")},
        "vllm": {"endpoints": [endpoint]},
        "drafter": {"kind": "dflash", "block_size": 4, "num_layers": 1},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def generation_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def prepared(plan: Plan) -> tuple[dict, list[list[dict]]]:
    report = json.loads(Path(plan.data.prepare_report).read_text())
    messages = [json.loads(m) for m in pq.read_table(plan.data.samples).column("messages").to_pylist()]
    return report, messages


@pytest.fixture(scope="module")
def first_run_progress(plain_server, smollm2_dir, tmp_path_factory) -> tuple[Plan, list[ProgressSnapshot]]:
    plan = Plan.load(write_recipe(tmp_path_factory.mktemp("first"), smollm2_dir, plain_server.url))
    snapshots: list[ProgressSnapshot] = []
    with reporting(snapshots.append):
        assert prepare_data(plan)
    return plan, snapshots


@pytest.fixture(scope="module")
def first_run(first_run_progress) -> Plan:
    return first_run_progress[0]


@pytest.mark.slow
def test_self_generated_preparation_is_clean_and_counts_every_drop(first_run):
    report, conversations = prepared(first_run)
    generation = report["self_generated"][LABEL]
    assert generation["kept"] >= 8  # 10 asked; a few may lose their reply
    # Every attempt is either a kept conversation or a drop with its reason, in both places.
    assert generation["attempted"] == generation["kept"] + sum(generation["dropped"].values())
    source = report["sources"][LABEL]
    assert source["dropped"] == generation["dropped"] and source["kind"] == "self_generated"
    assert generation["dropped"].get("truncated", 0) >= 1  # 32 tokens is short for SmolLM2's questions
    assert set(generation["dropped"]) <= {
        "empty",
        "truncated",
        "degenerate",
        "duplicate",
        "near_duplicate",
        "control_token",
        "reply_failed",
        "reply_empty",
    }
    assert report["kept"]["train"] + report["kept"]["eval"] == len(conversations) >= 8
    prompts = [c[0]["content"] for c in conversations]
    assert all(
        c[0]["role"] == "user" and c[1]["role"] == "assistant" and c[1]["content"] for c in conversations
    )
    assert len({normalise(p) for p in prompts}) == len(prompts)
    signatures = [minhash(shingles(p)) for p in prompts]
    for i in range(len(prompts)):
        for j in range(i):
            assert estimated_jaccard(signatures[i], signatures[j]) < 0.7, (prompts[i], prompts[j])


@pytest.mark.slow
def test_prompt_progress_counts_the_attempts_made_not_the_whole_budget(first_run_progress):
    plan, snapshots = first_run_progress
    prompts = [s for s in snapshots if s.label == "self-generating prompts"]
    last = prompts[-1]
    generation = prepared(plan)[0]["self_generated"][LABEL]
    assert last.finished and last.done == last.total, last
    # 10 prompts were kept out of the first batch of 32 attempts: the bar never announced the
    # 40-attempt budget (ETA and percentage then promised work that was not needed).
    assert generation["attempted"] <= last.total == 32 < 40
    assert all(s.total is not None and s.done <= s.total <= 32 for s in prompts)


@pytest.mark.slow
def test_kill_during_generation_then_resume_generates_only_the_rest_and_same_seed_same_data(
    first_run, plain_server, smollm2_dir, tmp_path
):
    recipe = write_recipe(tmp_path / "killed", smollm2_dir, plain_server.url)
    plan = Plan.load(recipe)
    assert plan.fingerprint == first_run.fingerprint and plan.data.root != first_run.data.root
    partial = Path(plan.data.generation_partial(0, str(tmp_path / "home")))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = (
        "import sys; from draftflow.plan import Plan; from draftflow.extraction.run import prepare_data; "
        "prepare_data(Plan.load(sys.argv[1]))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, recipe], env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and len(partial.read_text().splitlines()) >= 6:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "generation finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not Path(plan.data.prepare_report).exists()
    done_before = [json.loads(line) for line in partial.read_text().splitlines() if line.endswith("}")]
    assert len(done_before) >= 6

    requests_before = generation_requests(plain_server.url)
    assert prepare_data(plan)
    rerun = generation_requests(plain_server.url) - requests_before
    records = [json.loads(line) for line in partial.read_text().splitlines()]
    # One request per attempt's first turn and one per reply: the rerun made only the missing ones
    # (and the one-token probe that checks the server it was given does not extract).
    assert rerun == len(records) - len(done_before) + 1
    for kind in ("first", "conversation"):  # no step generated twice
        steps = [r[kind] for r in records if kind in r]
        assert len(steps) == len(set(steps)), kind
    report, conversations = prepared(plan)
    assert report["self_generated"][LABEL]["resumed_from_partial"] == len(done_before)
    # Same recipe and seed: the same prompts as the uninterrupted first run.
    _, first_conversations = prepared(first_run)
    assert sorted(c[0]["content"] for c in conversations) == sorted(
        c[0]["content"] for c in first_conversations
    )


@pytest.mark.slow
def test_target_that_writes_nothing_usable_stops_with_a_clear_error(plain_server, smollm2_dir, tmp_path):
    # 4 tokens are never enough for SmolLM2's questions: every attempt is truncated.
    plan = Plan.load(
        write_recipe(
            tmp_path, smollm2_dir, plain_server.url, max_tokens=4, num_prompts=4, max_attempts_ratio=20
        )
    )
    with pytest.raises(SelfGenerationError) as info:
        prepare_data(plan)
    message = str(info.value)
    assert "32 tried, 32 dropped" in message and "truncated 32" in message, message
    assert not Path(plan.data.prepare_report).exists()


@pytest.mark.slow
@pytest.mark.own_server  # the launch below takes the CPU host lock the shared server holds
def test_generation_server_launched_for_an_fp8_store_computes_in_a_dtype_vllm_serves(
    vllm_python, smollm2_dir, tmp_path
):
    """An FP8 store's server computes in bfloat16 (FP8 is how states are stored, not a dtype vLLM
    runs in): the plain generation server the preparation launches must be told the same."""
    port = free_port()
    recipe = yaml.safe_load(
        Path(write_recipe(tmp_path, smollm2_dir, f"http://127.0.0.1:{port}", num_prompts=3)).read_text()
    )
    recipe["data"]["eval_samples"] = 1
    recipe["extraction"]["dtype"] = "float8_e4m3"
    recipe["vllm"]["launch"] = {"python": vllm_python, "device": "cpu", "max_model_len": 1024}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    plan = Plan.load(str(tmp_path / "recipe.yaml"))
    logs = tmp_path / "logs"
    assert prepare_data(plan, launch=plan.recipe.vllm.launch, log_dir=str(logs))
    report, conversations = prepared(plan)
    assert report["self_generated"][LABEL]["kept"] == len(conversations) >= 1
    (log,) = logs.glob("vllm-*.log")
    assert "'dtype': 'bfloat16'" in log.read_text()
    assert not is_healthy(f"http://127.0.0.1:{port}")  # stopped before prepare_data returned
