"""The reference trainer (speculators 0.9.0) in its own virtualenv, installed on first use.

Its own virtualenv because its transformers range (>=5,<=5.19) differs from the project's.
``--no-deps`` for speculators / hs-connectors (their declared extras pull accelerator wheels),
then the pure-Python requirements they import; CPU torch at the project's pin. A stamp holding
the hash of this file's install lists makes a second call a no-op.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

TORCH_PIN = "torch==2.13.0"
PEER_PINS = ["speculators==0.9.0", "hs-connectors==0.9.0"]
PEER_REQUIREMENTS = [
    "aiohttp",
    "click",
    "datasets>=4,<=5.1",
    "httpx",
    "huggingface-hub",
    "loguru",
    "numpy",
    "openai",
    "protobuf",
    "psutil",
    "pydantic",
    "pydantic-settings",
    "rich",
    "safetensors",
    "tqdm",
    "transformers>=5,<=5.19",
    "typer",
    "tokenizers",
]


def peer_venv_dir() -> Path:
    home = Path(os.environ.get("DRAFTFLOW_HOME", Path.home() / ".cache" / "draftflow"))
    return home / "peer-venv"


def _stamp() -> str:
    text = "\n".join([TORCH_PIN, *PEER_PINS, *PEER_REQUIREMENTS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_peer_venv(log=print) -> Path:
    """The peer virtualenv's python, installing it first when its stamp is missing or stale."""
    venv = peer_venv_dir()
    python = venv / "bin" / "python"
    stamp = venv / ".draftflow-stamp"
    if stamp.is_file() and stamp.read_text().strip() == _stamp() and python.is_file():
        return python
    log(f"installing the reference trainer (speculators 0.9.0) into {venv} (first use, a few minutes)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, "--no-deps", *PEER_PINS], check=True)
    subprocess.run([*pip, *PEER_REQUIREMENTS], check=True)
    # CUDA builds of these break next to CPU torch; training needs none of them.
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "uninstall",
            "-q",
            "-y",
            "torchvision",
            "torchaudio",
            "torchcodec",
            "triton",
        ],
        check=False,
    )
    subprocess.run([str(python), "-c", "import speculators, torch"], check=True)
    stamp.write_text(_stamp() + "\n")
    return python


if __name__ == "__main__":
    print(ensure_peer_venv())
