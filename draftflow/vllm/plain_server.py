"""A plain vLLM server (no extraction flags) for generation: self-generated prompts and replies.

An extraction server drafts and rejects a token on every decode step (the
``extract_hidden_states`` speculative method) and writes a hidden-state file for every
request; generating text through it is much slower than through the same model served
plainly, and text it *samples* is not the target's: vLLM 0.32's ``extract_hidden_states``
method garbles sampled tokens (repeated words, junk), while greedy replies come out identical.
Preparation therefore runs against a plain server started here, which is stopped before the
extraction server starts on the same port. An endpoint that already answers is used only
when it checks out (the served model, extraction off when text is sampled, its dtype and
context length), and, for a run with launch settings, never when another draftflow run started
it; a server the pipeline did not start is never stopped or replaced.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence
from pathlib import Path

import httpx

from draftflow.recipe.load import expand
from draftflow.recipe.schema import VLLMLaunchSection
from draftflow.vllm.adopted import (
    WrongServerSettings,
    check_adopted_settings,
    extraction_enabled,
    refuse_another_runs_server,
)
from draftflow.vllm.client import auth_headers
from draftflow.vllm.server import EndpointDown, ServerHandle, _get_json, check_model, is_healthy, start_server

log = logging.getLogger(__name__)


def ensure_plain_running(
    endpoints: str | Sequence[str],
    *,
    model: str,
    api_key: str | None = None,
    launch: VLLMLaunchSection | None = None,
    dtype: str = "auto",
    log_dir: str | Path | None = None,
    health_timeout_s: float = 3.0,
    staging_dirs: Sequence[str] = (),
    min_model_len: int | None = None,
    sampled: bool = True,
) -> ServerHandle:
    """Endpoints that answer are checked (see the module docstring); dead ones get a plain server
    (``launch``). ``staging_dirs``: where a probe's hidden-state file may be deleted, should an
    answering server turn out to extract. ``sampled``: the text is sampled (self-generated
    prompts), not only greedy replies; an extraction server is then refused."""
    urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    urls = [u.rstrip("/") for u in urls]
    model = expand(model)
    handle = ServerHandle(endpoints=urls, api_key=api_key)
    atexit.register(handle.stop)
    try:
        for url in urls:
            if launch is not None:  # a run that starts its own servers never shares another run's
                refuse_another_runs_server(url)
            adopted = is_healthy(url, health_timeout_s)
            if not adopted:
                if launch is None:
                    raise EndpointDown(
                        f"no healthy vLLM server at {url} (GET /health failed) and the recipe has no "
                        "`vllm.launch` section to start one: start the server or add launch settings"
                    )
                # No layer ids: the launch spec gets neither the speculative nor the kv-transfer flags.
                handle.started.append(start_server(url, model, [], api_key, launch, dtype, log_dir))
                log.info("plain vLLM server (generation only) up at %s", url)
            with httpx.Client(base_url=url, headers=auth_headers(api_key), timeout=60.0) as http:
                served = _get_json(http, url, "/v1/models").get("data", [])
                served_id = check_model(url, model, served)
                if adopted:
                    entry = next(e for e in served if e.get("id") == served_id)
                    for note in check_adopted_settings(url, entry, dtype, min_model_len):
                        log.warning(note)
                    if not extraction_enabled(http, url, served_id, [expand(d) for d in staging_dirs]):
                        continue
                    if sampled:
                        raise WrongServerSettings(
                            f"{url} extracts hidden states (started with --kv-transfer-config): text it "
                            "samples is not the target's (tokens repeat and garble). Self-generated "
                            "data needs a plain server: stop that one, or let draftflow start one "
                            "(vllm.launch)"
                        )
                    log.warning("%s extracts hidden states: greedy replies through it are slower", url)
    except BaseException:
        handle.stop()
        raise
    return handle
