"""vLLM's hidden-state connector, made to work on CPU-only hosts.

This module is imported by the vLLM *server* (``kv_connector_module_path``), inside vLLM's
own virtualenv. It must therefore import nothing but vLLM, torch and the standard library:
never draftflow, never anything the vLLM venv lacks.

Why it exists: the stock ``ExampleHiddenStatesConnector._submit_async_write`` copies the
extracted states device-to-host into pinned memory on a CUDA side stream and hands the
writer thread a CUDA event. On CPU, ``pin_memory=True`` raises ("requires a CUDA or other
accelerator backend"), and vLLM's CPU stand-in for ``torch.cuda.Event`` has no ``query()``,
which ``get_finished`` polls. Here the states already live in host memory, so we copy them
synchronously and hand the writer pool an event that is already complete. Everything else
(lock files, writer threads, paths, scheduler side) is the stock behaviour.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class CompletedEvent:
    """Stands in for a CUDA event whose work is already done (the copy was synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous, unpinned copy for CPU hosts."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None

        # Same slot mapping as the stock connector: every slot of every block of the request.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]

        # clone(): the KV cache blocks are freed (and reused) as soon as we report the request
        # done, while the writer thread may still be serialising; it must own its copy.
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        prior = self._req_futures.get(pending.req_id)
        assert prior is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)

        # The lock normally was pre-created (LOCK_EX held) in wait_for_save before the client
        # saw the path; create it here only if that did not happen, as the stock code does.
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        done = CompletedEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
