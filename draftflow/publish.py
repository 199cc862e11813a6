"""Publishing a checkpoint folder: a model card, then an idempotent push.

A published version is named by the content hash of the folder, so pushing the same
checkpoint twice writes nothing the second time. fsspec destinations get the files
first and a `PUBLISHED` marker last (a reader trusts only marked versions); the Hugging
Face Hub path uploads one commit and skips it when the Hub already holds that hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import fsspec

from draftflow.paths import MODEL_CARD, join

PUBLISHED_MARKER = "PUBLISHED"
VERSION_FILE = "draftflow-version.json"


@dataclass(frozen=True)
class Published:
    location: str
    version: str
    pushed: bool  # False when that exact version was already there


def folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != VERSION_FILE):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def write_model_card(folder: Path, *, title: str, verifier: str, drafter_kind: str,
                     serve_command: str, report_markdown: str, recipe_name: str,
                     fingerprint: str, chart_file: str | None = None) -> Path:
    lines = [
        f"# {title}",
        "",
        f"A **{drafter_kind}** speculative-decoding drafter for `{verifier}`, trained with draftflow.",
        "The folder is in the speculators format: `vllm serve` loads it directly and serves the",
        "verifier with this drafter.",
        "",
        "```bash",
        serve_command,
        "```",
        "",
        "## Acceptance",
        "",
        report_markdown.strip(),
        "",
    ]
    if chart_file:
        lines += [f"![per-position acceptance]({chart_file})", ""]
    lines += [
        "## Provenance",
        "",
        f"- recipe: `{recipe_name}` (resolved copy in this folder)",
        f"- data fingerprint: `{fingerprint}`",
        "",
    ]
    path = folder / MODEL_CARD
    path.write_text("\n".join(lines))
    return path


def push_fsspec(folder: Path, dest_url: str, name: str, storage_options: dict | None = None) -> Published:
    version = folder_digest(folder)
    target = join(dest_url, f"{name}-{version}")
    fs, root = fsspec.core.url_to_fs(target, **(storage_options or {}))
    marker = f"{root}/{PUBLISHED_MARKER}"
    if fs.exists(marker):
        return Published(target, version, pushed=False)
    fs.makedirs(root, exist_ok=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path), f"{root}/{rel}")
    with fs.open(marker, "wb") as f:
        f.write(json.dumps({"version": version}).encode())
    return Published(target, version, pushed=True)


def push_hub(folder: Path, repo_id: str, token: str | None, api=None) -> Published:
    """Upload to the Hub unless its newest commit already carries this version."""
    from huggingface_hub import HfApi, hf_hub_download

    api = api or HfApi(token=token)
    version = folder_digest(folder)
    api.create_repo(repo_id, exist_ok=True, token=token)
    try:
        current = json.loads(Path(hf_hub_download(repo_id, VERSION_FILE, token=token)).read_text())
    except Exception:  # no such file yet (new repo), or not readable: upload
        current = {}
    location = f"hf://{repo_id}"
    if current.get("version") == version:
        return Published(location, version, pushed=False)
    (folder / VERSION_FILE).write_text(json.dumps({"version": version}))
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), token=token,
                      commit_message=f"draftflow checkpoint {version}")
    return Published(location, version, pushed=True)
