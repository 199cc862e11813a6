"""bench/gpu.py in its smoke mode: the GPU benchmark's code path on CPU at tiny sizes.

It runs from a plain copy of the repository (no PYTHONPATH, another working directory)
with the modules the GPU machine lacks made unimportable, as there.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Absent on the CUDA machine (pydantic, Prefect, vLLM) or not needed by the models; and every
# draftflow package above draftflow.models.
BLOCKED = (
    "pydantic",
    "prefect",
    "vllm",
    "yaml",
    "boto3",
    "botocore",
    "s3fs",
    "moto",
    "gguf",
    "fsspec",
    "pyarrow",
    "transformers",
    "huggingface_hub",
)
ALLOWED_DRAFTFLOW = ("draftflow.models", "draftflow.paths")  # and the bare package

RUNNER = textwrap.dedent("""
    import runpy, sys

    BLOCKED, ALLOWED = {blocked!r}, {allowed!r}

    class Missing:
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            outside = top == "draftflow" and name != "draftflow" and not any(
                name == a or name.startswith(a + ".") for a in ALLOWED)
            if top in BLOCKED or outside:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not on the GPU machine)")
            return None

    sys.meta_path.insert(0, Missing())
    sys.argv = ["bench/gpu.py", *sys.argv[1:]]
    runpy.run_path("bench/gpu.py", run_name="__main__")
""").format(blocked=BLOCKED, allowed=ALLOWED_DRAFTFLOW)


def _plain_copy(tmp: Path) -> Path:
    root = tmp / "copy"
    shutil.copytree(REPO / "draftflow", root / "draftflow", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "bench").mkdir()
    for name in ("gpu.py", "gpu_models.py"):
        shutil.copy(REPO / "bench" / name, root / "bench" / name)
    return root


def _run(root: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", RUNNER, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # ~30 s of CPU compute
def test_smoke_run_checks_flex_and_trains_every_point_with_only_the_models_importable(tmp_path):
    root = _plain_copy(tmp_path)
    out = tmp_path / "smoke.json"
    proc = _run(root, "--smoke", "--min-steps", "1", "--max-steps", "1", "--json", str(out), cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    names = subprocess.run(
        [sys.executable, "bench/gpu.py", "--smoke", "--list"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": ""},
    ).stdout.split()
    assert [c["name"] for c in result["checks"]] == ["check-dflash", "check-eagle3"]
    for check in result["checks"]:
        assert check["passed"] and check["max_rel_err"] <= check["tolerance"], check
    assert sorted(p["name"] for p in result["points"]) == sorted(names)
    assert {p["kind"] for p in result["points"]} == {"dflash", "eagle3"}
    assert any(p["checkpoint"] for p in result["points"])
    assert {p["loss"] for p in result["points"]} == {"target_logits", "tokens"}
    shipped = [p for p in result["points"] if p["block"]]  # the qwen3-8b-dflash recipe's step
    assert len(shipped) == 1 and shipped[0]["block"] < result["sizes"]["block"], shipped
    assert shipped[0]["draft_vocab"] < result["sizes"]["draft_vocab"] and shipped[0]["loss"] == "tokens"
    for point in result["points"]:
        assert point["status"] == "ok", point
        assert point["tokens_per_s"] > 0 and math.isfinite(point["last_loss"]), point
    assert "tokens/s" in proc.stdout and "check PASS" in proc.stdout


@pytest.mark.slow
def test_without_cuda_and_without_smoke_it_says_so_in_one_line_and_fails(tmp_path):
    root = _plain_copy(tmp_path)
    proc = _run(root, cwd=root)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "--smoke" in lines[0], proc.stderr
    assert proc.stdout == ""
