"""vLLM general plugin: fixes for vLLM's CPU build, one module each.

- :mod:`.k_norm`: multi-layer DFlash drafts as trained (vLLM's CPU kernel gave every drafter layer
  the first layer's ``k_norm``).
- :mod:`.engine_start`: the engine core is forked when the launcher asks for it (vLLM's CPU platform
  forces ``spawn``, which imports torch and vLLM again in it at every server start).

vLLM calls :func:`register` in the API server and in every process it spawns (a forked engine core
inherits the API server's patches). On any other platform it does nothing. This package must stay
importable without vLLM: draftflow reads :data:`FIXES` from the vLLM virtualenv to know which
defects are fixed there.
"""

from __future__ import annotations

from draftflow_vllm_cpu import engine_start, k_norm

__version__ = "0.2.0"

#: Defects this plugin fixes (draftflow asks for these names; keep them stable).
FIXES = (k_norm.FIX, engine_start.FIX)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: fix the CPU build, leave every other platform alone."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    k_norm.install()
    engine_start.install(type(current_platform))
