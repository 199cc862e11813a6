"""The staging sweep deletes only files of the names vLLM's hidden-states connector writes for
draftflow's requests, and refuses a staging folder that holds anything else.

A staging folder pointed at a model folder by mistake must lose nothing: the model here is a real
one (a tiny Llama saved by transformers, with SmolLM2's tokenizer), its files aged past any sweep
bound.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from pathlib import Path

import pytest

from draftflow.vllm.errors import InvalidHiddenStates
from draftflow.vllm.hidden_states_file import (
    ForeignStagingFolder,
    is_staging_name,
    staging_path,
    sweep_stale,
)

LONG_AGO = time.time() - 7 * 24 * 3600


def age(folder: Path, when: float = LONG_AGO) -> None:
    for p in folder.rglob("*"):
        os.utime(p, (when, when), follow_symlinks=False)


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, smollm2_dir: Path) -> Path:
    """A real model folder: config.json, model.safetensors, generation config and tokenizer files."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    return out


def test_a_model_folder_used_as_staging_loses_nothing(model_folder: Path):
    age(model_folder)
    before = snapshot(model_folder)
    with pytest.raises(ForeignStagingFolder) as err:
        sweep_stale(str(model_folder), older_than_s=600)
    message = str(err.value)
    assert str(model_folder) in message and "model.safetensors" in message
    assert snapshot(model_folder) == before


def test_a_model_folder_holding_stale_staging_files_is_still_refused(model_folder: Path, tmp_path: Path):
    """Even files the sweep would own are left alone while the folder holds someone else's."""
    import shutil

    staging = tmp_path / "staging"
    shutil.copytree(model_folder, staging)
    ours = staging / "cmpl-sample-000001-0-abcd1234.safetensors"
    ours.write_bytes(b"x")
    (staging / (ours.name + ".lock")).write_bytes(b"")
    age(staging)
    before = snapshot(staging)
    with pytest.raises(ForeignStagingFolder, match="config.json"):
        sweep_stale(str(staging), older_than_s=600)
    assert snapshot(staging) == before


def test_only_connector_names_are_swept(tmp_path: Path):
    staging = tmp_path / "staging"
    staging.mkdir()
    names = [
        "cmpl-0a1b2c3d4e5f60718293a4b5c6d7e8f9-0-1a2b3c4d.safetensors",  # a uuid request id
        "cmpl-sample-000042-0-deadbeef.safetensors",  # a sample id as request id
        "cmpl-draftflow-probe-1f2e-0-0badf00d.safetensors",
        "chatcmpl-0a1b2c3d-0badf00d.safetensors",
    ]
    for name in names:
        (staging / name).write_bytes(b"x")
        (staging / (name + ".lock")).write_bytes(b"")
    (staging / "cmpl-orphan-0-12345678.safetensors.lock").write_bytes(b"")  # request aborted
    age(staging)
    assert sweep_stale(str(staging), older_than_s=600) == len(names) + 1
    assert list(staging.iterdir()) == []


def test_a_held_lock_and_a_young_file_are_kept(tmp_path: Path):
    writing = tmp_path / "cmpl-writing-0-abcd1234.safetensors"
    young = tmp_path / "cmpl-young-0-abcd1234.safetensors"
    for path in (writing, young):
        path.write_bytes(b"x")
        Path(str(path) + ".lock").write_bytes(b"")
    age(tmp_path)
    now = time.time()
    os.utime(young, (now, now))
    held = os.open(str(writing) + ".lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # the server still writes it
    try:
        assert sweep_stale(str(tmp_path), older_than_s=600) == 0
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [writing.name, writing.name + ".lock", young.name, young.name + ".lock"]
    )


def test_a_symlink_of_a_connector_name_is_neither_followed_nor_deleted(tmp_path: Path):
    staging, elsewhere = tmp_path / "staging", tmp_path / "elsewhere"
    staging.mkdir()
    elsewhere.mkdir()
    target = elsewhere / "weights.safetensors"
    target.write_bytes(b"WEIGHTS")
    link = staging / "cmpl-link-0-abcd1234.safetensors"
    link.symlink_to(target)
    age(tmp_path)
    assert sweep_stale(str(staging), older_than_s=600) == 0
    assert link.is_symlink() and target.read_bytes() == b"WEIGHTS"


def test_a_missing_staging_folder_sweeps_nothing(tmp_path: Path):
    assert sweep_stale(str(tmp_path / "absent"), older_than_s=600) == 0


@pytest.mark.parametrize(
    "name, ours",
    [
        ("cmpl-abc-0-1234abcd.safetensors", True),
        ("cmpl-abc-0-1234abcd.safetensors.lock", True),
        ("chatcmpl-abc-1234abcd.safetensors", True),
        ("model.safetensors", False),
        ("model-00001-of-00002.safetensors", False),
        ("cmpl-.safetensors", False),
        ("cmpl-abc.safetensors.bak", False),
        ("config.json", False),
        (".cmpl-abc-0-1234abcd.safetensors", False),
    ],
)
def test_staging_names(name: str, ours: bool):
    assert is_staging_name(name) is ours


def test_a_server_naming_a_model_file_in_staging_gets_it_refused(model_folder: Path):
    """A server's answer naming `model.safetensors` inside the staging folder is refused untouched."""
    before = snapshot(model_folder)
    with pytest.raises(InvalidHiddenStates, match="left untouched"):
        staging_path(str(model_folder / "model.safetensors"), [str(model_folder)])
    assert snapshot(model_folder) == before


WRITER = """
import sys, torch
from safetensors.torch import save_file
save_file({"hidden_states": torch.zeros(96 * 1024 * 1024)}, sys.argv[1])
"""


def test_a_write_killed_midway_leaves_a_temp_file_the_sweep_removes(tmp_path: Path):
    """safetensors (as vLLM's connector calls it) writes through a temporary sibling `.tmpXXXXXX` renamed
    into place: a server killed mid-write leaves it. It is the connector's, so the sweep removes it once
    old enough, and the folder is not taken for a foreign one (the next run could not start)."""
    import subprocess
    import sys

    staging = tmp_path / "staging"
    staging.mkdir()
    name = "cmpl-sample-000007-0-0badf00d.safetensors"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(staging / name)])
    deadline = time.monotonic() + 60
    while not [p for p in staging.iterdir() if p.name.startswith(".tmp") and p.stat().st_size]:
        assert writer.poll() is None and time.monotonic() < deadline, "no temporary file seen while writing"
        time.sleep(0.005)
    writer.kill()
    writer.wait()
    left = [p.name for p in staging.iterdir()]
    assert len(left) == 1 and left[0].startswith(".tmp") and name not in left  # killed before the rename

    assert sweep_stale(str(staging), older_than_s=600) == 0  # young: maybe a write in progress
    assert [p.name for p in staging.iterdir()] == left
    age(staging)
    assert sweep_stale(str(staging), older_than_s=600) == 1
    assert list(staging.iterdir()) == []


# Preloaded into the real writer: its first write() to a `.tmp*` file marks HOLD_MARKER and waits,
# so the process is held after safetensors sized its temporary file (ftruncate) and before any
# byte of it is written, the instant a kill must not leave the staging folder unusable.
HOLD_FIRST_TEMP_WRITE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

ssize_t write(int fd, const void *buf, size_t count) {
    static ssize_t (*real_write)(int, const void *, size_t);
    if (!real_write) real_write = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t len = readlink(link, path, sizeof path - 1);
    if (len > 0) {
        path[len] = 0;
        const char *base = strrchr(path, '/');
        if (base && strncmp(base + 1, ".tmp", 4) == 0) {
            const char *marker = getenv("HOLD_MARKER");
            if (marker) close(open(marker, O_CREAT | O_WRONLY, 0600));
            for (;;) pause();
        }
    }
    return real_write(fd, buf, count);
}
"""


def test_a_write_killed_after_sizing_its_temp_file_leaves_zeros_the_sweep_removes(tmp_path: Path):
    """safetensors 0.8 sizes its temporary file (ftruncate to the final length) and then writes it:
    a server killed between the two leaves a `.tmpXXXXXX` of zeros. The CLI kill test met it
    (ForeignStagingFolder on the next run); the sweep treats it as the connector's write too."""
    import shutil
    import subprocess
    import sys

    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "this test builds a small preload library: install a C compiler (gcc)"
    source, library = tmp_path / "hold.c", tmp_path / "hold.so"
    source.write_text(HOLD_FIRST_TEMP_WRITE)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"], check=True)
    staging = tmp_path / "staging"
    staging.mkdir()
    marker = tmp_path / "held"
    env = {**os.environ, "LD_PRELOAD": str(library), "HOLD_MARKER": str(marker)}
    name = "cmpl-sample-000007-0-0badf00d.safetensors"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(staging / name)], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not marker.exists():
        if writer.poll() is not None or time.monotonic() > deadline:
            writer.kill()
            pytest.fail(
                f"the writer was not held at its write (preload ignored?): {writer.communicate()[1][-2000:]}"
            )
        time.sleep(0.01)
    writer.kill()
    writer.wait()
    (temp,) = staging.iterdir()
    assert temp.name.startswith(".tmp") and temp.stat().st_size > 96 * 1024 * 1024 * 4
    with temp.open("rb") as f:
        assert f.read(1 << 16) == bytes(1 << 16)  # sized, nothing written

    assert sweep_stale(str(staging), older_than_s=600) == 0  # young: maybe a write in progress
    assert list(staging.iterdir()) == [temp]
    age(staging)
    assert sweep_stale(str(staging), older_than_s=600) == 1
    assert list(staging.iterdir()) == []


def test_a_temp_named_file_that_is_not_a_safetensors_write_is_foreign(tmp_path: Path):
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / ".tmpAb12Cd").write_text("notes that are not a safetensors file\n")
    age(staging)
    with pytest.raises(ForeignStagingFolder, match=r"\.tmpAb12Cd"):
        sweep_stale(str(staging), older_than_s=600)
    assert (staging / ".tmpAb12Cd").exists()
