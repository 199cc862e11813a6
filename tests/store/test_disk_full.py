"""A store write that runs out of space fails with the OS error and leaves nothing behind: no temp
file, no shard object, no fragment, so the space is free again for the retry.

On a real full filesystem (a 1 MiB tmpfs; needs root and mount permission) and, everywhere, in a
child process whose file-size limit (RLIMIT_FSIZE) stops the write the same way part-way.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import store_synthetic as syn

from draftflow.paths import is_temp_name
from draftflow.store import Store, read_manifest, write_shard

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_shard_larger_than_the_free_space_leaves_no_file(full_disk: Path):
    store = Store.at(str(full_disk / "data"))
    small = write_shard(store, "000000", [syn.sample("a")], syn.info())  # fits
    before = _files(full_disk)
    # 4 samples x 2000 tokens x 3 layers x 64 x 4 bytes = 6 MiB: the disk fills part-way.
    big = [syn.sample(f"b{i}", 2000, dtype="float32", hidden_size=64) for i in range(4)]
    with pytest.raises(OSError) as err:
        write_shard(store, "000001", big, syn.info(dtype="float32", hidden_size=64))
    assert err.value.errno == errno.ENOSPC
    assert _files(full_disk) == before  # no temp file, no shard object, no fragment
    assert shutil.disk_usage(full_disk).used < 256 * 1024  # the space is free again
    manifest = read_manifest(store)
    assert set(manifest["shard_id"].to_pylist()) == {"000000"}
    assert any(small.shard_url.endswith(f) for f in before)


CHILD = textwrap.dedent(
    """
    import errno, resource, signal, sys
    sys.path.insert(0, sys.argv[2])
    import store_synthetic as syn
    from draftflow.store import Store, write_shard

    store = Store.at(sys.argv[1])
    write_shard(store, "000000", [syn.sample("a")], syn.info())
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    big = [syn.sample(f"b{i}", 2000, dtype="float32", hidden_size=64) for i in range(4)]
    try:
        write_shard(store, "000001", big, syn.info(dtype="float32", hidden_size=64))
    except OSError as err:
        print("errno", errno.errorcode[err.errno])
    """
)


@pytest.mark.slow
def test_a_write_stopped_by_a_file_size_limit_leaves_no_file(tmp_path: Path):
    root = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(TESTS)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "errno EFBIG" in done.stdout, done.stdout + done.stderr
    files = _files(root)
    assert not [f for f in files if is_temp_name(os.path.basename(f))], files
    assert len([f for f in files if f.startswith("shards/")]) == 1, files  # the first shard only
    assert len([f for f in files if f.startswith("manifest/")]) == 1, files  # and its fragment
