"""The test stack itself is real: SmolLM2 is a pretrained model, S3 speaks HTTP, Prefect runs flows
(vLLM serving SmolLM2: tests/vllm/test_server_checks_real.py, beside the other plain-server tests)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_target_is_a_real_pretrained_model(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])


def test_s3_fixture_is_a_real_http_endpoint(s3):
    import os

    import s3fs

    fs = s3fs.S3FileSystem(**s3["storage_options"])
    blob = os.urandom(12 * 1024 * 1024)  # above s3fs's block size: a real multipart upload
    path = f"{s3['url']}/stack/blob.bin"
    with fs.open(path, "wb", block_size=5 * 1024 * 1024) as f:
        f.write(blob)
    assert fs.cat_file(path) == blob
    assert fs.cat_file(path, start=100, end=200) == blob[100:200]
    assert httpx.get(s3["endpoint"] + "/draftflow-test/stack/blob.bin").status_code in (200, 403)


def test_prefect_harness_runs_flows_against_a_real_api(prefect_harness):
    from prefect import flow, task
    from prefect.client.orchestration import get_client

    @task
    def double(x: int) -> int:
        return 2 * x

    @flow
    def tiny(n: int) -> int:
        return sum(double.map(range(n)).result())

    assert tiny(4) == 12

    async def count_runs() -> int:
        async with get_client() as client:
            return len(await client.read_flow_runs())

    import asyncio

    assert asyncio.run(count_runs()) >= 1
