"""The real test stack: vLLM (CPU build, own virtualenv), SmolLM2, loopback S3, Prefect.

Nothing here is a mock. Fixtures that need the bootstrap (`make test` runs it) fail with
the command to run when something is missing; they never skip.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Prefect reads its settings when first imported: isolate it before any test imports it.
_PREFECT_TMP = Path(tempfile.mkdtemp(prefix="draftflow-prefect-"))
os.environ.setdefault("PREFECT_HOME", str(_PREFECT_TMP / "home"))
os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(_PREFECT_TMP / "storage"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402

pytest.register_assert_rewrite("suite_plugin")
from suite_plugin import CENSUS  # noqa: E402

from draftflow.recipe.load import default_home  # noqa: E402
from draftflow.vllm.launch import LaunchSpec, ServerProcess, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["suite_plugin", "pytester"]
BOOTSTRAP_HINT = "run `make test` (or `make bootstrap`) first"


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for in-process torch work. The models under test are tiny, and on a
    shared 2-core host two threads spin against the vLLM server and other processes (measured:
    Eagle3 overfit 0.5 s vs 9 s; a SmolLM2 forward ~20 ms vs >100 ms)."""
    import torch  # not every test needs torch; only its first use pays for the import

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def draftflow_home() -> Path:
    return default_home()


@pytest.fixture(scope="session")
def smollm2_dir(draftflow_home: Path) -> Path:
    """The real SmolLM2-135M-Instruct target as a safetensors folder (fp32), converted once."""
    from draftflow.gguf_target import convert, is_converted, smollm2_gguf

    out = draftflow_home / "models" / "SmolLM2-135M-Instruct"
    if not is_converted(out):
        convert(smollm2_gguf(), out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer: shapes, not quality."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def vllm_python(draftflow_home: Path) -> str:
    python = draftflow_home / "vllm-venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"vLLM virtualenv missing at {python}: {BOOTSTRAP_HINT}")
    return str(python)


class VLLMServers:
    """Starts real vLLM servers, one at a time (two on a 2-core host hang at start-up).

    Asking again for the same settings returns the running server, unless it died or stopped
    answering: then a new one replaces it. Asking for different settings stops the running one
    first. The collection hook below orders modules so that those sharing settings run back to
    back; tests marked `own_server` get a fresh server that nobody after them reuses.
    """

    def __init__(self, python: str, log_dir: Path):
        self.python = python
        self.log_dir = log_dir
        self.current: tuple[tuple, ServerProcess] | None = None
        self.startups = 0

    def get(self, model: Path | str, **settings) -> ServerProcess:
        # the tests' prompts are short; all cores compute, as in the shipped CPU recipes
        settings = {"max_model_len": 1024, "cpu_reserved_cores": 0, **settings}
        key = (str(model), repr(sorted(settings.items())))  # the settings in effect, defaults included
        if self.current and self.current[0] == key and _answers(self.current[1]):
            return self.current[1]
        self.stop()  # the launcher's host lock makes other test sessions wait, not hang
        self.assert_none_alive()
        port = free_port()
        spec = LaunchSpec(
            python=self.python,
            model=str(model),
            port=port,
            device="cpu",
            dtype="float32",
            log_path=str(self.log_dir / f"vllm-{port}.log"),
            **settings,
        )
        server = ServerProcess(spec).start()
        self.startups += 1
        server.wait_healthy(timeout_s=300)
        self.current = (key, server)
        return server

    def assert_none_alive(self) -> None:
        """No vLLM server of this test process runs: a test that started its own left it behind."""
        alive = CENSUS.live_vllm_servers()
        if alive:
            started = {s.pid: s.test for s in CENSUS.starts}
            listed = "; ".join(
                f"pid {p.pid} (started during {started.get(p.pid, 'an unknown test')})" for p in alive
            )
            pytest.fail(f"a vLLM server is still running before the pool starts one: {listed}")

    def stop(self) -> None:
        if self.current:
            self.current[1].stop()
            self.current = None


def _answers(server: ServerProcess) -> bool:
    if server.proc.poll() is not None:
        return False
    try:
        return httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def vllm_servers(vllm_python: str, tmp_path_factory):
    servers = VLLMServers(vllm_python, tmp_path_factory.mktemp("vllm-logs"))
    yield servers
    servers.stop()


@pytest.fixture(autouse=True)
def _own_server(request):
    """`@pytest.mark.own_server`: the test kills or breaks its server, or launches one itself (the
    CPU host lock allows one), so the pool's is stopped first and dropped afterwards."""
    if request.node.get_closest_marker("own_server") is None:
        yield
        return
    servers = request.getfixturevalue("vllm_servers")
    servers.stop()
    yield
    servers.stop()


@pytest.fixture(scope="session")
def staging_dir(tmp_path_factory) -> Path:
    """Where the test extraction server writes hidden-state files (shared with the tests: same host).
    One folder for every test folder, so they all share one extraction server."""
    return tmp_path_factory.mktemp("hidden-state-staging")


@pytest.fixture(scope="module")
def extraction_server(vllm_servers, smollm2_dir: Path, staging_dir: Path):
    """SmolLM2 (fp32, CPU) extracting LAYER_IDS into `staging_dir`: the pool's, so every module that
    asks for it (tests/extraction, tests/prefect, ...) shares one server."""
    from extraction_helpers import LAYER_IDS

    return vllm_servers.get(
        smollm2_dir, extract_layer_ids=LAYER_IDS, staging_dir=str(staging_dir), max_model_len=1024
    )


@pytest.fixture(scope="module")
def plain_server(vllm_servers, smollm2_dir: Path):
    """SmolLM2 (fp32, CPU) served without extraction, as a serving deployment would be: the pool's,
    shared by every module that asks for it."""
    return vllm_servers.get(smollm2_dir)


@pytest.fixture
def extraction_endpoint(extraction_server) -> str:
    return extraction_server.url


# Modules that use the same pooled server run back to back (fewest start-ups); within a module
# the order is the file's. Whole modules move, so module-scoped fixtures are set up once. Modules
# on `prefect_harness` run after those on `prefect_server`: once entered, the harness points this
# process's Prefect client at itself for the rest of the session. A module with an `own_server`
# test runs last among those sharing its server, which that test stops.
SERVER_GROUPS = {"extraction_server": 1, "plain_server": 2}


def pytest_collection_modifyitems(config, items):
    first_seen: dict[str, int] = {}
    key_of: dict[str, tuple[bool, bool, int, bool]] = {}
    for index, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        first_seen.setdefault(module, index)
        slow = item.get_closest_marker("slow") is not None
        harness = "prefect_harness" in item.fixturenames
        group = min((g for name, g in SERVER_GROUPS.items() if name in item.fixturenames), default=9)
        own = item.get_closest_marker("own_server") is not None  # stops the shared server: last in its group
        was_slow, had_harness, was_group, had_own = key_of.get(module, (False, False, 9, False))
        key_of[module] = (was_slow or slow, had_harness or harness, min(was_group, group), had_own or own)
    items.sort(key=lambda item: (*key_of[m := item.nodeid.split("::")[0]], first_seen[m]))


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 HTTP endpoint (moto server) on loopback with one bucket.

    Yields a dict with `url` (s3://bucket) and `storage_options` for fsspec/s3fs.
    """
    from loopback_s3 import start_s3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server, info = start_s3("draftflow-test")
    yield info
    server.stop()


@pytest.fixture
def full_disk():
    """A 1 MiB tmpfs: writes past it fail with ENOSPC (skipped where mounting is not allowed)."""
    import subprocess

    mount = Path(tempfile.mkdtemp(prefix="draftflow-full-disk-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        mount.rmdir()


@pytest.fixture(scope="session")
def prefect_harness():
    """A real (temporary, SQLite) Prefect server for tests whose behaviour depends on it.

    Not for tests/prefect: once entered (for the rest of the session) it points this process's
    client away from the `prefect server start` that runners there use (use `prefect_server`)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield
