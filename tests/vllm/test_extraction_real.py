"""Real extraction through a vLLM server (CPU build) that `ensure_running` launched.

All tests here share one SmolLM2 server (module-scoped fixture, ~30 s to start) that
requires an API key, so every check below also proves the key is sent.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from draftflow.process_group import group_alive
from draftflow.vllm.client import RequestFailed, VLLMClient
from draftflow.vllm.plain_server import ensure_plain_running
from draftflow.vllm.server import (
    ServerCheckError,
    WrongLayers,
    WrongModel,
    WrongServerSettings,
    ensure_running,
    is_healthy,
)

pytestmark = pytest.mark.slow


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    short = tok.apply_chat_template(
        [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
        ],
        tokenize=False,
    )
    # Long enough to span many KV-cache blocks: a wrong slot mapping would show here.
    long = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(30))
    return [tok(short)["input_ids"], tok(long)["input_ids"][:400]]


@pytest.fixture(scope="module")
def reference_states(smollm2_dir: Path, prompts, smollm2_extraction):
    """transformers' hidden states for the same tokens, with id 30 taken BEFORE the final norm."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    captured = {}

    def before_final_norm(_module, _inputs, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    hook = model.model.layers[-1].register_forward_hook(before_final_norm)
    out = []
    with torch.no_grad():
        for ids in prompts:
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            layers = [
                hs[i][0] if i < len(model.model.layers) else captured["last"][0]
                for i in smollm2_extraction.layer_ids
            ]
            out.append(torch.stack(layers, dim=1))  # [tokens, layers, hidden], the file's layout
    hook.remove()
    return out


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32 agreement, scaled per token: SmolLM2 carries activation outliers of ~2.5e4, and
    30 layers of fp32 rounding leave absolute differences of ~3e-2 there (1e-6 relative).
    A wrong layer, token or slot would be off by O(1) relative to the token's RMS."""
    token_rms = want.pow(2).mean(-1, keepdim=True).sqrt()
    err = (got - want).abs()
    bound = 1e-4 * want.abs() + 5e-4 * token_rms
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: max |diff| {err.max().item():.2e}, {worst:.2f}x the fp32 bound"


def test_launched_server_is_ours_and_logged(smollm2_extraction):
    assert len(smollm2_extraction.handle.started) == 1
    log = Path(smollm2_extraction.handle.log_paths[0]).read_text()
    assert "CPUHiddenStatesConnector" in log and "draftflow.vllm.cpu_connector" in log
    assert "the engine core starts by fork, its worker by spawn" in log  # vLLM's CPU platform says spawn
    assert smollm2_extraction.handle.unverified == []  # ids are known: we started it with them


def test_server_information(smollm2_extraction, smollm2_dir):
    async def go():
        async with smollm2_extraction.handle.client() as c:
            return await c.health(), await c.models(), await c.version()

    healthy, models, version = run(go())
    assert healthy and models == [str(smollm2_dir)] and version.startswith("0.")


def test_extracted_states_equal_transformers(smollm2_extraction, prompts, reference_states):
    """Every layer id, both prompts, and a prefix served from vLLM's prefix cache (causal
    model: a prefix's states are the full prompt's states cut short)."""
    cases = [(p, ref) for p, ref in zip(prompts, reference_states)]
    cases.append((prompts[1][:150], reference_states[1][:150]))

    async def go():
        async with smollm2_extraction.handle.client(
            num_layers=len(smollm2_extraction.layer_ids), hidden_size=smollm2_extraction.hidden_size
        ) as c:
            return [await c.extract(p, request_id=f"ref-{i}") for i, (p, _) in enumerate(cases)]

    for sample, (ids, ref) in zip(run(go()), cases):
        assert sample.token_ids.tolist() == ids
        assert sample.hidden_states.dtype == torch.float32
        assert sample.hidden_states.shape == (
            len(ids),
            len(smollm2_extraction.layer_ids),
            smollm2_extraction.hidden_size,
        )
        for j, layer in enumerate(smollm2_extraction.layer_ids):
            assert_fp32_close(sample.hidden_states[:, j], ref[:, j], f"layer id {layer}, {len(ids)} tokens")


def test_data_parallel_extraction_over_two_endpoints(smollm2_extraction, prompts):
    """Two URLs (same server, two spellings) stand in for two servers; order is preserved."""
    port = smollm2_extraction.url.rsplit(":", 1)[1]
    endpoints = [f"http://127.0.0.1:{port}", f"http://localhost:{port}"]
    items = [(f"s{i}", prompts[i % 2][: 20 + 7 * i]) for i in range(10)]

    async def go():
        async with VLLMClient(
            endpoints,
            api_key=smollm2_extraction.api_key,
            concurrency=2,
            num_layers=len(smollm2_extraction.layer_ids),
            hidden_size=smollm2_extraction.hidden_size,
            staging_dirs=[str(smollm2_extraction.staging_dir)],
        ) as c:
            return await c.extract_many(items)

    results = run(go())
    assert [r.request_id.rsplit("-", 1)[0] for r in results] == [i for i, _ in items]  # + a unique suffix
    assert all(r.token_ids.tolist() == list(t) for r, (_, t) in zip(results, items))
    assert {r.endpoint for r in results} == set(endpoints)
    assert list(smollm2_extraction.staging_dir.iterdir()) == []


def test_too_long_prompt_is_a_clean_4xx_not_retried(smollm2_extraction):
    async def go():
        async with smollm2_extraction.handle.client(retries=3) as c:
            return await c.extract([1] * smollm2_extraction.max_model_len)

    with pytest.raises(RequestFailed) as info:
        run(go())
    assert info.value.status == 400


def test_chat_regenerates_and_leaves_no_files(smollm2_extraction):
    question = [{"role": "user", "content": "What is the capital of France?"}]

    async def go():
        async with smollm2_extraction.handle.client() as c:
            return await c.chat(question, max_tokens=16), await c.chat_reply(question, max_tokens=16)

    text, reply = run(go())
    assert "Paris" in text and reply.text == text  # greedy: the same reply twice
    assert reply.finish_reason in ("stop", "length") and 0 < reply.completion_tokens <= 16
    assert list(smollm2_extraction.staging_dir.iterdir()) == []


def check(server, model, layer_ids=None, hidden_size=None, api_key="same", **kwargs):
    """ensure_running against the running server, as a pipeline that did not start it."""
    kwargs.setdefault("staging_dirs", [str(server.staging_dir)])
    return ensure_running(
        server.url,
        model=str(model),
        layer_ids=server.layer_ids if layer_ids is None else layer_ids,
        hidden_size=hidden_size or server.hidden_size,
        api_key=server.api_key if api_key == "same" else api_key,
        **kwargs,
    )


def test_running_server_is_checked_and_accepted_but_not_owned(smollm2_extraction, smollm2_dir):
    with check(smollm2_extraction, str(smollm2_dir) + "/") as h:  # same folder, spelt differently
        assert h.started == []
        assert "layer ids cannot be read over HTTP" in h.unverified[0]
    assert is_healthy(smollm2_extraction.url)  # leaving the context did not stop a server it did not start


def test_a_server_too_short_for_the_recipes_samples_is_refused(smollm2_extraction, smollm2_dir):
    with pytest.raises(WrongServerSettings, match=r"takes at most 512 tokens .*--max-model-len 4096"):
        check(smollm2_extraction, smollm2_dir, min_model_len=4096)
    with check(smollm2_extraction, smollm2_dir, min_model_len=512, dtype="float32") as h:
        assert h.started == [] and len(h.unverified) == 1  # length and dtype checked: only layer ids not


def test_an_extraction_server_is_never_used_to_sample_text(smollm2_extraction, smollm2_dir):
    """Text an extraction server samples is not the target's (vLLM 0.32's extract_hidden_states
    garbles sampled tokens; greedy replies are identical): self-generation refuses it, greedy
    regeneration uses it, and the probe's hidden-state file is not left behind."""
    with pytest.raises(WrongServerSettings, match="extracts hidden states .* needs a plain server"):
        ensure_plain_running(
            smollm2_extraction.url,
            model=str(smollm2_dir),
            api_key=smollm2_extraction.api_key,
            staging_dirs=[str(smollm2_extraction.staging_dir)],
        )
    with ensure_plain_running(
        smollm2_extraction.url,
        model=str(smollm2_dir),
        api_key=smollm2_extraction.api_key,
        staging_dirs=[str(smollm2_extraction.staging_dir)],
        sampled=False,
    ) as handle:
        assert handle.started == []
    assert list(smollm2_extraction.staging_dir.iterdir()) == []
    assert is_healthy(smollm2_extraction.url)  # not ours to stop


def test_wrong_model_names_both(smollm2_extraction, smollm2_dir, tiny_llama_dir):
    with pytest.raises(WrongModel) as info:
        check(smollm2_extraction, tiny_llama_dir, layer_ids=[1, 2], hidden_size=64)
    assert str(tiny_llama_dir) in str(info.value) and str(smollm2_dir) in str(info.value)


def test_wrong_layer_count_is_rejected(smollm2_extraction, smollm2_dir):
    with pytest.raises(
        WrongLayers,
        match=r"extracts 5 layers per token, but the recipe expects 3 \(layer ids \[2, 15, 30\]\)",
    ):
        check(smollm2_extraction, smollm2_dir, layer_ids=[2, 15, 30])


def test_unverifiable_layer_ids_are_refused_when_strict(smollm2_extraction, smollm2_dir):
    with pytest.raises(WrongLayers, match="layer ids cannot be read over HTTP.*strict_layer_ids refuses it"):
        check(smollm2_extraction, smollm2_dir, strict_layer_ids=True)


def test_wrong_hidden_size_is_rejected(smollm2_extraction, smollm2_dir):
    with pytest.raises(WrongLayers, match="hidden size 576, but the target's hidden size is 64"):
        check(smollm2_extraction, smollm2_dir, hidden_size=64)


def test_missing_api_key_is_reported(smollm2_extraction, smollm2_dir):
    with pytest.raises(ServerCheckError, match="HTTP 401: the API key was rejected or is missing"):
        check(smollm2_extraction, smollm2_dir, api_key=None)


def test_client_with_wrong_api_key_gets_401_without_retries(smollm2_extraction):
    async def go():
        async with VLLMClient(smollm2_extraction.url, api_key="wrong-key", retries=3, backoff_s=5) as c:
            return await c.extract([1, 2, 3])

    with pytest.raises(RequestFailed) as info:
        run(go())  # backoff_s=5: a retry would make this test take seconds
    assert info.value.status == 401


def test_api_key_is_in_no_child_argv_and_store_secrets_in_no_child_env(smollm2_extraction):
    """Every process of the launched server (watchdog, API server, engine): /proc/PID/cmdline
    never holds the API key (any user can read it with ps); the environment has no store options."""
    from draftflow.process_env import STORAGE_OPTIONS_ENV
    from draftflow.process_group import live_members

    [server] = smollm2_extraction.handle.started
    members = live_members(server.pid)
    assert len(members) >= 2  # the watchdog and vLLM at least
    for pid in members:
        argv = open(f"/proc/{pid}/cmdline", "rb").read()
        assert smollm2_extraction.api_key.encode() not in argv, argv
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert not any(v.startswith(STORAGE_OPTIONS_ENV.encode() + b"=") for v in environ)


def test_staging_dir_is_empty_after_everything(smollm2_extraction):
    assert list(smollm2_extraction.staging_dir.iterdir()) == []


def test_a_server_slow_to_answer_health_is_not_taken_for_dead(smollm2_extraction):
    """Frozen for 8 s (longer than a /health timeout): restart_dead waits for it instead of
    stopping a live server, and the same process serves on."""
    import threading

    import psutil

    handle = smollm2_extraction.handle
    [server] = handle.started
    [api] = [c for c in psutil.Process(server.pid).children() if "vllm.entrypoints" in " ".join(c.cmdline())]
    api.suspend()
    thaw = threading.Timer(8.0, api.resume)
    thaw.start()
    try:
        assert handle.restart_dead(handle.restarts) is True
    finally:
        thaw.cancel()
        api.resume()
    assert handle.started == [server] and server.alive() and api.is_running()
    assert is_healthy(smollm2_extraction.url)


def test_handle_stops_the_server_it_started(smollm2_extraction):
    """Runs last in this module: stopping here is what the fixture's teardown would do."""
    proc = smollm2_extraction.handle.started[0]
    pid, url = proc.pid, smollm2_extraction.url
    smollm2_extraction.handle.stop()
    assert proc.proc.poll() is not None
    assert not group_alive(pid)  # no process of its group (engine core, workers) runs on
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
