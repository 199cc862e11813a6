"""Which vLLM defects draftflow's vLLM plugin fixes in a given vLLM virtualenv.

The plugin (``plugins/draftflow_vllm_cpu``, installed into the vLLM virtualenv by
``scripts/bootstrap.sh``) registers under vLLM's ``vllm.general_plugins`` entry point group and
lists the defects it fixes in ``FIXES``. vLLM is never imported here: we ask the virtualenv's own
interpreter, with the environment its server would get, which entry points it has, so a plugin that
is missing, or filtered out by ``VLLM_PLUGINS``, is reported as no fix.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from draftflow.models.known_issues import DFLASH_CPU_K_NORM

__all__ = ["CPU_ENGINE_START", "DFLASH_CPU_K_NORM", "PLUGIN_NAME", "installed_fixes"]

#: The plugin forks vLLM's CPU engine core when ``vllm.launch.cpu_engine_start`` says ``fork``.
CPU_ENGINE_START = "cpu-engine-start-from-env"
PLUGIN_NAME = "draftflow_vllm_cpu"
PLUGIN_DIR = Path(__file__).resolve().parents[2] / "plugins" / PLUGIN_NAME

# Runs in the vLLM virtualenv: entry points only (no vLLM import), then the plugin module's FIXES.
_PROBE = f"""
import importlib, importlib.metadata as md, json, os
allowed = os.environ.get("VLLM_PLUGINS")
names = None if allowed is None else [n.strip() for n in allowed.split(",")]
fixes = []
for ep in md.entry_points(group="vllm.general_plugins"):
    if ep.name == {PLUGIN_NAME!r} and (names is None or ep.name in names):
        fixes = list(importlib.import_module(ep.module).FIXES)
print(json.dumps(fixes))
"""


def installed_fixes(python: str, env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The defects fixed by the plugin a server started with ``python`` and ``env`` (added to this
    process's environment, as the launcher does) would load; empty if it has none."""
    merged = {**os.environ, **(env or {})}
    return _probe(python, merged.get("PYTHONPATH"), merged.get("VLLM_PLUGINS"))


@functools.lru_cache(maxsize=16)
def _probe(python: str, pythonpath: str | None, vllm_plugins: str | None) -> frozenset[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    env.update(
        {k: v for k, v in (("PYTHONPATH", pythonpath), ("VLLM_PLUGINS", vllm_plugins)) if v is not None}
    )
    try:
        out = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=env, check=True
        )
        return frozenset(json.loads(out.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return frozenset()  # no such interpreter, or a broken plugin: nothing is known to be fixed
