"""`ensure_running` against a healthy server that serves the target without extraction.

Its own server (from the shared `vllm_servers` fixture): SmolLM2 started without the
extraction flags, as a plain serving deployment would be.
"""

from __future__ import annotations

import pytest

from draftflow.vllm.client import ExtractionNotEnabled
from draftflow.vllm.server import ensure_running

pytestmark = pytest.mark.slow


def test_server_without_extraction_is_rejected(vllm_servers, smollm2_dir):
    server = vllm_servers.get(smollm2_dir)
    with pytest.raises(ExtractionNotEnabled) as info:
        ensure_running(server.url, model=str(smollm2_dir), layer_ids=[2, 15, 27, 30], hidden_size=576)
    message = str(info.value)
    assert "hidden-state extraction is not enabled" in message and str(smollm2_dir) in message
