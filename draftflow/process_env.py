"""Settings that cross a process boundary (CLI, torchrun workers) through environment variables.

Secrets travel here rather than on the command line, where any user of the host can read
them with ``ps``. The Prefect blocks (``blocks/``) turn into these variables for subprocesses.
"""

from __future__ import annotations

import json
import os

STORAGE_OPTIONS_ENV = "DRAFTFLOW_STORAGE_OPTIONS"  # JSON object of fsspec options for the store
VLLM_API_KEY_ENV = "DRAFTFLOW_VLLM_API_KEY"  # sent as a Bearer token to every vLLM endpoint


def storage_options_from_env() -> dict:
    raw = os.environ.get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{STORAGE_OPTIONS_ENV} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{STORAGE_OPTIONS_ENV} must be a JSON object, got {type(value).__name__}")
    return value


def vllm_api_key_from_env() -> str | None:
    return os.environ.get(VLLM_API_KEY_ENV) or None
