"""Fault trials for publishing: kill -9 during a push, to a local folder and to S3 on loopback.

    .venv/bin/python bench/publish_faults.py --kills 10

A checkpoint-sized folder (``--files`` files of random bytes, a few MB in all) is pushed with
:func:`draftflow.publish.push_fsspec` by a child process that is killed with SIGKILL after a
random delay within one uninterrupted push's duration, ``--kills`` times per destination.
After every kill the destination is audited: a version that looks complete (local: its folder
exists; S3: its ``PUBLISHED`` marker exists) must hold every file byte for byte. A final push
must then complete the version. S3 is a real S3 HTTP endpoint (moto) on loopback; credentials
reach the child through ``$DRAFTFLOW_STORAGE_OPTIONS``, never its argv.

Prints one JSON line per destination. No timing is measured here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "publish-faults"
TRIAL_FILE = "trial.json"
CHILD = """
import json, os, sys
from pathlib import Path
from draftflow.process_env import storage_options_from_env
from draftflow.publish import push_fsspec
print("ready", flush=True)
push_fsspec(Path(sys.argv[1]), sys.argv[2], sys.argv[3], storage_options_from_env())
print("done", flush=True)
"""


def make_checkpoint(folder: Path, files: int, rng: random.Random) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (folder / f"part-{i:02d}.bin").write_bytes(rng.randbytes(256 * 1024))
    (folder / "config.json").write_text(json.dumps({"files": files}))
    return folder


def _env(storage_options: dict) -> dict:
    from draftflow.process_env import STORAGE_OPTIONS_ENV

    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env[STORAGE_OPTIONS_ENV] = json.dumps(storage_options)
    return env


def _start(folder: Path, dest: str, storage_options: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(folder), dest, NAME],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(storage_options),
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def push_seconds(folder: Path, dest: str, storage_options: dict) -> float:
    """One uninterrupted push, timed from the child's imports done to the push's end."""
    proc = _start(folder, dest, storage_options)
    started = time.monotonic()
    assert proc.stdout.readline().strip() == "done"
    took = time.monotonic() - started
    assert proc.wait(timeout=600) == 0
    return took


def audit(folder: Path, dest: str, storage_options: dict) -> dict:
    """Versions at ``dest`` that look complete, and how many of them are torn: a file missing or
    not byte for byte the pushed one (``trial.json`` says which trial's folder it was)."""
    import fsspec

    from draftflow.publish import PUBLISHED_MARKER

    fs, root = fsspec.core.url_to_fs(dest, **storage_options)
    fs.invalidate_cache()  # the child wrote since this process last listed
    local = "file" in fs.protocol or fs.protocol == "local"
    complete, torn = 0, 0
    for entry in fs.ls(root, detail=False) if fs.exists(root) else []:
        base = entry.rstrip("/").rsplit("/", 1)[-1]
        if not base.startswith(NAME + "-"):
            continue  # a hidden partial copy: not a version
        if not local and not fs.exists(f"{entry}/{PUBLISHED_MARKER}"):
            continue
        complete += 1
        torn += int(not _intact(fs, entry, folder) or not fs.exists(f"{entry}/{PUBLISHED_MARKER}"))
    return {"looks_complete": complete, "torn": torn}


def _intact(fs, entry: str, folder: Path) -> bool:
    try:
        trial = json.loads(fs.cat_file(f"{entry}/{TRIAL_FILE}"))["trial"]
    except (FileNotFoundError, ValueError, KeyError):
        return False
    expected = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != TRIAL_FILE}
    expected[TRIAL_FILE] = _trial_bytes(trial)
    for name, blob in expected.items():
        if not fs.exists(f"{entry}/{name}") or fs.cat_file(f"{entry}/{name}") != blob:
            return False
    return True


def _trial_bytes(trial: int) -> bytes:
    return json.dumps({"trial": trial}).encode()


def kill_trials(folder: Path, dest: str, storage_options: dict, kills: int, rng: random.Random) -> dict:
    """Each trial pushes a new version (its own ``trial.json``) and is killed within one push's
    duration; the audit runs after every kill. The last trial's version is then pushed whole."""
    (folder / TRIAL_FILE).write_bytes(_trial_bytes(-1))
    duration = push_seconds(folder, dest + "-timing", storage_options)
    torn_seen, landed = 0, {"before the end": 0, "after the end": 0}
    for trial in range(kills):
        (folder / TRIAL_FILE).write_bytes(_trial_bytes(trial))
        proc = _start(folder, dest, storage_options)
        time.sleep(rng.uniform(0, duration))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        landed["after the end" if "done" in proc.stdout.read() else "before the end"] += 1
        torn_seen += audit(folder, dest, storage_options)["torn"]
    final = _start(folder, dest, storage_options)
    assert final.wait(timeout=600) == 0
    versions = audit(folder, dest, storage_options)
    return {
        "kills": kills,
        "landed": landed,
        "push_s": round(duration, 3),
        "torn_versions_seen": torn_seen,
        "final": versions,
    }


def _loopback_s3() -> tuple[object, dict]:
    spec = importlib.util.spec_from_file_location("loopback_s3", REPO / "tests" / "loopback_s3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server, info = module.start_s3("publish-faults")
    return server, info["storage_options"]


def run(kills: int, files: int, seed: int, work: Path, backends: tuple[str, ...] = ("local", "s3")) -> dict:
    rng = random.Random(seed)
    folder = make_checkpoint(work / "checkpoint", files, rng)
    out = {}
    if "local" in backends:
        out["local"] = kill_trials(folder, str(work / "published"), {}, kills, rng)
    if "s3" in backends:
        server, options = _loopback_s3()
        try:
            out["s3"] = kill_trials(folder, "s3://publish-faults/published", options, kills, rng)
        finally:
            server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="kill -9 trials per destination")
    parser.add_argument("--files", type=int, default=64, help="files in the checkpoint folder (256 KiB each)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="draftflow-publish-faults-") as work:
        for backend, result in run(args.kills, args.files, args.seed, Path(work)).items():
            print(json.dumps({"fault": "kill -9 during publish", "destination": backend, **result}))


if __name__ == "__main__":
    main()
