"""kill -9 during publishing, local and on the loopback S3: the release pointer always names a
complete version (the new one or the one before), and a reader polling ``current()`` meanwhile
never gets a version without its PUBLISHED marker or with a file missing or torn."""

from __future__ import annotations

import hashlib
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from draftflow.model_card import HISTORY_CHART_FILE
from draftflow.process_env import STORAGE_OPTIONS_ENV
from draftflow.publish import PUBLISHED_MARKER, folder_digest
from draftflow.releases import MOVES, Releases

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RECIPE = "rel-test"  # the name in the recipe of tests/publish/conftest.py's checkpoints
KILLS = 5
NOT_VERSIONED = {"README.md", HISTORY_CHART_FILE, PUBLISHED_MARKER}  # written per publish: not compared
CHILD = """
import sys
from draftflow.process_env import storage_options_from_env
from draftflow.publish import Destination, publish
destination = Destination.parse(sys.argv[3], storage_options=storage_options_from_env())
print("ready", flush=True)
publish(sys.argv[1], sys.argv[2], destination)
print("done", flush=True)
"""


def _start(folder: Path, report: Path, url: str, options: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), STORAGE_OPTIONS_ENV: json.dumps(options)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(folder), str(report), url],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _files(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file() and p.name not in NOT_VERSIONED
    }


def _intact(releases: Releases, folder: str, expected: dict[str, str]) -> bool:
    """The version folder holds exactly the pushed files, byte for byte, and its marker."""
    fs, root = releases.fs, f"{releases.root}/{folder}"
    names = {p.removeprefix(root + "/") for p in fs.find(root)}
    if names - NOT_VERSIONED != set(expected) or PUBLISHED_MARKER not in names:
        return False
    return all(hashlib.sha256(fs.cat_file(f"{root}/{n}")).hexdigest() == h for n, h in expected.items())


class Reader(threading.Thread):
    """Polls ``current()`` while the publisher runs, as `vllm serve $(draftflow releases current …)` would."""

    def __init__(self, url: str, options: dict):
        super().__init__(daemon=True)
        self.releases = Releases(url, RECIPE, options)
        self.seen: set[str] = set()
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                release = self.releases.current()
                if self.releases.marker(release.folder) is None:
                    self.errors.append(f"{release.folder} returned without its marker")
                self.seen.add(release.version)
            except Exception as err:  # noqa: BLE001 - any failure of a reader is the finding
                self.errors.append(repr(err))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_killed_publish_leaves_current_on_a_complete_version(backend, checkpoint, tmp_path, request):
    if backend == "s3":
        s3 = request.getfixturevalue("s3")
        url, options = f"{s3['url']}/kill-{uuid.uuid4().hex[:8]}", s3["storage_options"]
    else:
        url, options = str(tmp_path / "published"), {}
    rng = random.Random(46)
    folder, report = checkpoint(1)
    (folder / "blob.bin").write_bytes(rng.randbytes(16 << 20))  # large-ish: the push takes a while
    (folder / "acceptance.png").write_bytes(
        (report.parent / "acceptance.png").read_bytes()
    )  # as publish does
    expected: dict[str, dict[str, str]] = {}

    def next_version(trial: int) -> str:  # same weights and report, another folder digest
        (folder / "trial.json").write_text(json.dumps({"trial": trial}))
        version = folder_digest(folder)
        expected[version] = _files(folder)
        return version

    releases = Releases(url, RECIPE, options)
    durations, chain = [], []  # chain: the versions the pointer named, in order
    for trial in (-2, -1):  # two uninterrupted publishes: the first pays for cold caches
        previous = next_version(trial)
        proc = _start(folder, report, url, options)
        started = time.monotonic()
        assert proc.stdout.readline().strip() == "done" and proc.wait(timeout=300) == 0
        durations.append(time.monotonic() - started)
        assert releases.current().version == previous
        chain.append(previous)
    duration = min(durations)  # one publish, from the child's imports done to its end

    landed = {"before the end": 0, "after the end": 0}
    for trial in range(1, KILLS + 1):
        version = next_version(trial)
        reader = Reader(url, options)
        proc = _start(folder, report, url, options)
        started = time.monotonic()
        reader.start()
        with selectors.DefaultSelector() as wait:  # until the kill instant, or "done" before it
            wait.register(proc.stdout, selectors.EVENT_READ)
            if wait.select(timeout=rng.uniform(0, duration)):
                duration = time.monotonic() - started  # it took this long: aim the next kills within
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        reader.stop.set()
        reader.join(timeout=60)
        landed["after the end" if "done" in proc.stdout.read() else "before the end"] += 1

        release = releases.current()
        assert release.version in (previous, version), (trial, release)
        assert _intact(releases, release.folder, expected[release.version]), (trial, release)
        assert reader.errors == [] and reader.seen <= {previous, version}, (trial, reader.errors, reader.seen)
        moves = [e["version"] for e in releases.history() if e["event"] in MOVES]
        # the history ends with the pointer's line, or just before it (killed between the two writes)
        assert moves[-1] in (release.version, release.previous), (trial, moves, release)
        assert [v.version for v in releases.versions() if v.current] == [release.version]
        if release.version != chain[-1]:
            chain.append(release.version)
        previous = release.version

    proc = _start(folder, report, url, options)  # the last trial's version, uninterrupted
    assert proc.wait(timeout=300) == 0
    release = releases.current()
    assert release.version == version and _intact(releases, release.folder, expected[version])
    # every version that was current has its line, in order: a line a kill prevented was recovered
    chain += [version] if chain[-1] != version else []
    assert [e["version"] for e in releases.history() if e["event"] in MOVES] == chain
    assert landed["before the end"] >= 1, landed  # at least one kill mid-publish
