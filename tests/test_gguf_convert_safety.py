"""`convert` writes into a fresh hidden folder and renames it into place: a folder it did not create
(the user's, at the destination or beside it) is never deleted, and a conversion that fails (here:
the disk fills) leaves nothing behind."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from draftflow.gguf_target import READY_MARKER, convert, smollm2_gguf


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"mine": true}')
    (path / "notes.txt").write_text("a week of work")
    return path


def test_a_users_folder_at_the_destination_is_refused_untouched(tmp_path: Path):
    out = user_folder(tmp_path / "SmolLM2-135M-Instruct")
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=rf"{out}.*not a draftflow conversion"):
        convert(smollm2_gguf(), out)
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temp folder left either


def test_a_file_at_the_destination_is_refused_untouched(tmp_path: Path):
    out = tmp_path / "model"
    out.write_text("not a folder")
    with pytest.raises(FileExistsError, match=str(out)):
        convert(smollm2_gguf(), out)
    assert out.read_text() == "not a folder"


@pytest.mark.slow  # ~25 s: a whole conversion
def test_an_empty_destination_is_filled_and_a_users_partial_folder_beside_it_kept(tmp_path: Path):
    out = tmp_path / "SmolLM2-135M-Instruct"
    out.mkdir()
    theirs = user_folder(tmp_path / "SmolLM2-135M-Instruct.partial")
    before = snapshot(theirs)
    convert(smollm2_gguf(), out)
    assert (out / READY_MARKER).is_file() and (out / "model.safetensors").stat().st_size > 0
    assert snapshot(theirs) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, theirs.name])


@pytest.mark.slow  # ~20 s: dequantises the model before the write fails
def test_a_conversion_that_fills_the_disk_leaves_nothing(full_disk: Path):
    # safetensors reports the OSError as a SafetensorError carrying the OS message.
    with pytest.raises(Exception, match="No space left on device"):
        convert(smollm2_gguf(), full_disk / "SmolLM2-135M-Instruct")
    assert list(full_disk.iterdir()) == []
