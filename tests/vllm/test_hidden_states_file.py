"""The hidden-states file protocol: lock, read (safetensors only), validate, always delete.

Files are built here in a temp dir exactly as vLLM's connector writes them, including a
writer that holds the exclusive lock while it "writes".
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from draftflow.vllm.client import (
    ExtractionNotEnabled,
    InvalidHiddenStates,
    hidden_states_path,
    read_hidden_states,
    validate_hidden_states,
)

PROMPT = [5, 17, 42, 7]


def write_sample(path, tokens=PROMPT, layers=3, hidden=8, hidden_states=None, lock=True):
    hs = hidden_states if hidden_states is not None else torch.randn(len(tokens), layers, hidden)
    save_file({"hidden_states": hs, "token_ids": torch.tensor(tokens, dtype=torch.int64)}, str(path))
    if lock:
        (path.parent / (path.name + ".lock")).touch()
    return hs


def assert_gone(path):
    assert not path.exists() and not (path.parent / (path.name + ".lock")).exists()


def test_valid_file_is_read_and_both_files_deleted(tmp_path):
    path = tmp_path / "cmpl-a-0-1234abcd.safetensors"
    hs = write_sample(path)
    tokens, hidden = read_hidden_states(str(path), PROMPT, num_layers=3, hidden_size=8)
    assert tokens.tolist() == PROMPT and tokens.dtype == torch.int64
    assert torch.equal(hidden, hs)
    assert_gone(path)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"tokens": [5, 17, 43, 7]}, "first difference at position 2"),
        ({"tokens": [5, 17, 42]}, "token_ids in file (3 tokens) != prompt (4 tokens)"),
        ({"layers": 2}, "has 2 layers, expected 3"),
        ({"hidden": 16}, "hidden size is 16, expected 8"),
        ({"hidden_states": torch.full((4, 3, 8), float("nan"))}, "96 non-finite values"),
        ({"hidden_states": torch.randn(3, 3, 8)}, "covers 3 tokens, prompt has 4"),
    ],
)
def test_invalid_file_raises_with_reason_and_is_deleted(tmp_path, kwargs, reason):
    path = tmp_path / "bad.safetensors"
    write_sample(path, **kwargs)
    with pytest.raises(InvalidHiddenStates) as info:
        read_hidden_states(str(path), PROMPT, num_layers=3, hidden_size=8)
    assert reason in info.value.reason
    assert info.value.path == str(path)
    assert_gone(path)


def test_corrupt_file_is_reported_not_loaded(tmp_path):
    path = tmp_path / "corrupt.safetensors"
    write_sample(path)
    path.write_bytes(path.read_bytes()[:40])  # a write cut short
    with pytest.raises(InvalidHiddenStates, match="unreadable safetensors file"):
        read_hidden_states(str(path), PROMPT)
    assert_gone(path)


def test_pickle_is_never_loaded(tmp_path):
    path = tmp_path / "pickled.safetensors"
    torch.save({"hidden_states": torch.zeros(4, 3, 8), "token_ids": torch.tensor(PROMPT)}, path)
    (tmp_path / "pickled.safetensors.lock").touch()
    with pytest.raises(InvalidHiddenStates, match="unreadable safetensors file"):
        read_hidden_states(str(path), PROMPT)
    assert_gone(path)


def test_missing_tensor(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"hidden_states": torch.zeros(4, 3, 8)}, str(path))
    (tmp_path / "x.safetensors.lock").touch()
    with pytest.raises(InvalidHiddenStates, match=r"lacks tensor\(s\) \['token_ids'\]"):
        read_hidden_states(str(path), PROMPT)


def test_missing_lock_file_says_staging_dir_must_be_shared(tmp_path):
    path = tmp_path / "nolock.safetensors"
    write_sample(path, lock=False)
    with pytest.raises(InvalidHiddenStates, match="lock file missing"):
        read_hidden_states(str(path), PROMPT)
    assert_gone(path)


def test_reader_waits_for_writer_lock(tmp_path):
    """vLLM returns the path before the write ends; the reader must wait for LOCK_EX to go."""
    path = tmp_path / "late.safetensors"
    lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    written = {}

    def writer():
        time.sleep(0.3)
        written["hs"] = write_sample(path, lock=False)
        os.close(lock_fd)  # releases LOCK_EX, as the connector's writer thread does

    thread = threading.Thread(target=writer)
    start = time.monotonic()
    thread.start()
    _, hidden = read_hidden_states(str(path), PROMPT, num_layers=3, hidden_size=8)
    thread.join()
    assert time.monotonic() - start >= 0.25
    assert torch.equal(hidden, written["hs"])
    assert_gone(path)


def test_writer_that_never_finishes_times_out(tmp_path):
    path = tmp_path / "stuck.safetensors"
    lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(InvalidHiddenStates, match="writer still holds the lock"):
            read_hidden_states(str(path), PROMPT, lock_timeout_s=0.2)
    finally:
        os.close(lock_fd)


def test_validate_accepts_bf16():
    hs = torch.randn(4, 2, 8).to(torch.bfloat16)
    tokens, hidden = validate_hidden_states(
        {"hidden_states": hs, "token_ids": torch.tensor(PROMPT)}, PROMPT, 2, 8
    )
    assert hidden.dtype == torch.bfloat16 and tokens.tolist() == PROMPT


def test_response_without_path_means_extraction_not_enabled():
    body = {"choices": [{"prompt_token_ids": PROMPT}], "kv_transfer_params": None}
    with pytest.raises(ExtractionNotEnabled, match="not enabled"):
        hidden_states_path(body, "http://h:1", PROMPT, [])


def test_response_echoing_other_tokens_is_invalid(tmp_path):
    path = tmp_path / "cmpl-echo-0-abcd1234.safetensors"
    write_sample(path)
    body = {
        "choices": [{"prompt_token_ids": [1, 2]}],
        "kv_transfer_params": {"hidden_states_path": str(path)},
    }
    with pytest.raises(InvalidHiddenStates, match="differ from the 4 sent"):
        hidden_states_path(body, "http://h:1", PROMPT, [str(tmp_path)])
    assert_gone(path)
