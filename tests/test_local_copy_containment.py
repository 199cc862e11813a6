"""``remote.local_copy`` downloads a remote folder file by file: a key that points outside the
folder (a ``..`` segment, an absolute path after the prefix) is refused before anything is
written, on S3 (moto on loopback) and on another fsspec backend (in-memory) alike."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest

from draftflow.paths import remote_copy, remote_copy_stamp
from draftflow.remote import local_copy


def _s3_put(s3: dict, key: str, body: bytes = b"x") -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3["endpoint"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.put_object(Bucket=s3["url"].removeprefix("s3://"), Key=key, Body=body)


def _hostile_keys(tmp_path: Path) -> dict[str, Path]:
    """Key suffix under the folder -> where an unchecked copy would have written it."""
    home = tmp_path / "home"
    outside = tmp_path / "outside"
    return {
        "../../../escaped.txt": tmp_path / "escaped.txt",  # copy is home/remote-copies/<name>
        f"/{outside}/absolute.txt": outside / "absolute.txt",
        "sub/../../../../up.txt": tmp_path / "up.txt",
        "./../dotted.txt": home / "remote-copies" / "dotted.txt",
    }


def _assert_refused(url: str, options: dict | None, tmp_path: Path, suffix: str, target: Path) -> None:
    home = tmp_path / "home"
    with pytest.raises(ValueError) as err:
        local_copy(url, options, local_home=str(home))
    message = str(err.value)
    assert url in message and suffix in message and "outside" in message
    assert not target.exists(), f"{target} written through key {suffix!r}"
    assert not Path(remote_copy(url, str(home))).exists()
    assert not Path(remote_copy_stamp(url, str(home))).exists()
    leftovers = list((home / "remote-copies").glob("*")) if (home / "remote-copies").exists() else []
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.parametrize("index", range(4))
def test_hostile_s3_key_is_refused_and_nothing_is_written(s3, tmp_path: Path, index: int):
    suffix, target = list(_hostile_keys(tmp_path).items())[index]
    prefix = f"{uuid.uuid4().hex}/export"
    _s3_put(s3, f"{prefix}/model.safetensors")
    _s3_put(s3, f"{prefix}/{suffix}", b"hostile")
    _assert_refused(f"{s3['url']}/{prefix}", s3["storage_options"], tmp_path, suffix, target)


@pytest.mark.parametrize("index", range(4))
def test_hostile_key_on_another_backend_is_refused(tmp_path: Path, index: int):
    suffix, target = list(_hostile_keys(tmp_path).items())[index]
    fs = fsspec.filesystem("memory")
    folder = f"/{uuid.uuid4().hex}/export"
    fs.pipe(f"{folder}/config.json", b"{}")
    fs.pipe(f"{folder}/{suffix}", b"hostile")
    try:
        _assert_refused(f"memory://{folder}", None, tmp_path, suffix, target)
    finally:
        fs.rm(folder.split("/export")[0], recursive=True)


@pytest.mark.slow
def test_ordinary_nested_keys_are_still_copied(s3, tmp_path: Path):
    prefix = f"{uuid.uuid4().hex}/export"
    _s3_put(s3, f"{prefix}/config.json", b"{}")
    _s3_put(s3, f"{prefix}/vocab/draft-vocab.safetensors", b"v")
    _s3_put(s3, f"{prefix}/name..with..dots.txt", b"d")
    _s3_put(s3, f"{prefix}/vocab/", b"")  # a folder marker, as the S3 console writes them
    copy = local_copy(f"{s3['url']}/{prefix}", s3["storage_options"], local_home=str(tmp_path / "home"))
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()) == [
        "config.json",
        "name..with..dots.txt",
        "vocab/draft-vocab.safetensors",
    ]
