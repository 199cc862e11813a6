"""Fixtures for the vLLM tests: one SmolLM2 extraction server started through `ensure_running`.

Only one vLLM server may run at a time on this host, so the fixture first stops whatever
the session-wide `vllm_servers` fixture holds, and it is module-scoped: it is stopped when
the module that uses it finishes, before other modules ask `vllm_servers` for theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm.launch import free_port

# Ids 0 (embeddings), inner layers, 29 (input of the last layer) and 30 (last layer output,
# before the final norm): the cases where off-by-one errors in layer ids would show.
SMOLLM2_LAYER_IDS = [0, 2, 15, 29, 30]
SMOLLM2_HIDDEN = 576
SMOLLM2_MAX_MODEL_LEN = 512
API_KEY = "draftflow-test-key"  # the launched server requires it: every check must send it


@dataclass
class ExtractionServer:
    handle: object  # draftflow.vllm.server.ServerHandle
    layer_ids: list[int]
    hidden_size: int
    max_model_len: int
    staging_dir: Path
    api_key: str

    @property
    def url(self) -> str:
        return self.handle.endpoints[0]


@pytest.fixture(scope="module")
def smollm2_extraction(vllm_servers, vllm_python: str, smollm2_dir: Path, tmp_path_factory):
    """SmolLM2 with extraction (fp32, CPU, API key), launched by `ensure_running`."""
    from draftflow.vllm.server import ensure_running

    vllm_servers.stop()
    work = tmp_path_factory.mktemp("smollm2-extraction")
    launch = VLLMLaunchSection(
        python=vllm_python,
        device="cpu",
        max_model_len=SMOLLM2_MAX_MODEL_LEN,
        staging_dir=str(work / "staging"),
        startup_timeout_s=300,
    )
    handle = ensure_running(
        f"http://127.0.0.1:{free_port()}",
        model=str(smollm2_dir),
        layer_ids=SMOLLM2_LAYER_IDS,
        hidden_size=SMOLLM2_HIDDEN,
        api_key=API_KEY,
        launch=launch,
        dtype="float32",
        log_dir=work / "logs",
    )
    yield ExtractionServer(
        handle, SMOLLM2_LAYER_IDS, SMOLLM2_HIDDEN, SMOLLM2_MAX_MODEL_LEN, Path(launch.staging_dir), API_KEY
    )
    handle.stop()
