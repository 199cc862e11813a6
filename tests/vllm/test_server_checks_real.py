"""The pool's `plain_server`: SmolLM2 started without the extraction flags, as a plain serving
deployment would be. It is the real vLLM serving the real target, and `ensure_running` refuses it
for extraction.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from draftflow.vllm.client import ExtractionNotEnabled
from draftflow.vllm.server import ensure_running

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_plain_server_is_the_real_vllm_serving_smollm2(plain_server, smollm2_dir):
    server = plain_server
    assert server.pid and server.proc.poll() is None
    version = httpx.get(f"{server.url}/version", timeout=10).json()["version"]
    assert version.startswith("0.32")
    models = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
    assert models == [str(smollm2_dir)]
    reply = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": models[0], "messages": QUESTION, "max_tokens": 16, "temperature": 0},
        timeout=60,
    ).json()
    assert "Paris" in reply["choices"][0]["message"]["content"]
    # cpu_reserved_cores: 0 (the CPU recipes' setting) leaves no core out of vLLM's compute threads
    log = Path(server.spec.log_path).read_text()
    assert "reserve_cpu_num=0" in log and "reserved_cpus=[]" in log, log[-3000:]


def test_server_without_extraction_is_rejected(plain_server, smollm2_dir):
    server = plain_server
    with pytest.raises(ExtractionNotEnabled) as info:
        ensure_running(server.url, model=str(smollm2_dir), layer_ids=[2, 15, 27, 30], hidden_size=576)
    message = str(info.value)
    assert "hidden-state extraction is not enabled" in message and str(smollm2_dir) in message
