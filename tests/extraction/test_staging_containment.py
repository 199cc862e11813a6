"""A server-named hidden-states path outside the staging folder is never read nor deleted.

The endpoint is a small HTTP server on loopback that speaks the extraction protocol: the
probe gets a real, valid file in the staging folder (so the server passes its checks), every
sample request gets a path that should never be touched: a planted "private key", a model's
weights, a symlink inside staging that points to the key, and a ``..`` escape. The real
extraction stage runs against it (real preparation with SmolLM2's tokenizer, real store).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch
from extraction_helpers import HIDDEN, LAYER_IDS, write_recipe_file
from safetensors.torch import save as save_safetensors

from draftflow.extraction import run_extraction
from draftflow.plan import Plan
from draftflow.store import Store, read_manifest
from draftflow.vllm.hidden_states_file import sweep_stale


class HostileEndpoint:
    """Answers like an extraction server, but names `evil_paths` (round-robin) for samples."""

    def __init__(self, model: str, staging: Path, evil_paths: list[str]):
        self.evil = itertools.cycle(evil_paths)
        self.sample_requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send({"data": [{"id": model, "root": model}]})
                else:  # /health, /version
                    self._send({"version": "0.0-hostile"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["prompt"]
                if self.headers.get("X-Request-Id", "").startswith("draftflow-probe"):
                    path = str(staging / f"cmpl-draftflow-probe-{len(prompt)}-0-abcd1234.safetensors")
                    tensors = {
                        "token_ids": torch.tensor(prompt, dtype=torch.int64),
                        "hidden_states": torch.zeros(len(prompt), len(LAYER_IDS), HIDDEN),
                    }
                    Path(path).write_bytes(save_safetensors(tensors))
                    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    os.close(fd)
                else:
                    owner.sample_requests += 1
                    path = next(owner.evil)
                self._send(
                    {
                        "choices": [{"text": "x", "prompt_token_ids": prompt}],
                        "kv_transfer_params": {"hidden_states_path": path},
                    }
                )

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def plant(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    Path(str(path) + ".lock").write_bytes(b"")  # so a reader would not even wait for a lock
    return path


def test_paths_outside_staging_are_never_read_or_deleted(smollm2_dir: Path, tmp_path: Path):
    staging = tmp_path / "staging"
    staging.mkdir()
    key = plant(tmp_path / "home" / ".ssh" / "id_ed25519.safetensors", b"PRIVATE KEY")
    weights = plant(tmp_path / "models" / "target" / "model.safetensors", b"WEIGHTS")
    (staging / "cmpl-link-0-abcd1234.safetensors").symlink_to(key)
    evil = [
        str(key),
        str(weights),
        str(staging / "cmpl-link-0-abcd1234.safetensors"),
        str(staging / ".." / "models" / "target" / "model.safetensors"),
    ]
    server = HostileEndpoint(str(smollm2_dir), staging, evil)
    try:
        recipe = write_recipe_file(
            tmp_path / "recipe.yaml",
            smollm2_dir,
            str(tmp_path / "store"),
            server.url,
            str(staging),
            num_samples=8,
            eval_samples=0,
        )
        plan = Plan.load(recipe)
        summary = run_extraction(plan, launch=None)
    finally:
        server.close()

    assert server.sample_requests == summary.samples_total == 8
    # Every sample failed with a reason that says why; nothing planted was touched.
    assert summary.samples_ok == 0 and summary.samples_failed == 8
    manifest = read_manifest(Store(plan.data))
    failed = manifest.filter(pc.equal(manifest["status"], "failed"))
    reasons = failed["failure_reason"].to_pylist()
    assert len(reasons) == 8
    assert all("left untouched" in r for r in reasons), reasons
    assert any("outside the staging folder" in r for r in reasons) and any("symlink" in r for r in reasons)
    assert any("'..'" in r for r in reasons)
    for planted, content in ((key, b"PRIVATE KEY"), (weights, b"WEIGHTS")):
        assert planted.read_bytes() == content
        assert Path(str(planted) + ".lock").exists()
    assert (staging / "cmpl-link-0-abcd1234.safetensors").is_symlink()
    assert not list(staging.glob("cmpl-draftflow-probe-*"))  # the legitimate probe file was read and deleted


def test_sweep_skips_symlinks(tmp_path: Path):
    staging = tmp_path / "staging"
    staging.mkdir()
    target = plant(tmp_path / "elsewhere" / "weights.safetensors", b"WEIGHTS")
    (staging / "cmpl-old-0-abcd1234.safetensors").symlink_to(target)
    os.utime(staging / "cmpl-old-0-abcd1234.safetensors", (0, 0), follow_symlinks=False)
    os.utime(target, (0, 0))
    stale = plant(staging / "cmpl-stale-0-abcd1234.safetensors", b"x")
    os.utime(stale, (0, 0))
    assert sweep_stale(str(staging), older_than_s=60) == 1
    assert (
        not stale.exists()
        and target.read_bytes() == b"WEIGHTS"
        and (staging / "cmpl-old-0-abcd1234.safetensors").is_symlink()
    )


@pytest.mark.parametrize("path", ["relative.safetensors", "/etc/passwd"])
def test_client_refuses_without_touching(tmp_path: Path, path: str):
    from draftflow.vllm.client import InvalidHiddenStates
    from draftflow.vllm.hidden_states_file import staging_path

    with pytest.raises(InvalidHiddenStates, match="left untouched"):
        staging_path(path, [str(tmp_path)])
