"""A Prefect runner serving deployments of draftflow flows; the Prefect tests start it as a subprocess.

    python serve_runner.py SPEC.json

SPEC.json is a list of {"flow": "module:attribute", "name": ..., "parameters": {...},
"interval_s": optional}. The runner executes each flow run in a child process, with this
process's environment (PREFECT_API_URL, result storage, the test-only fault variables).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from importlib import import_module
from pathlib import Path


def main(spec_path: str) -> None:
    from prefect import serve

    deployments = []
    for spec in json.loads(Path(spec_path).read_text()):
        module, attribute = spec["flow"].split(":")
        flow = getattr(import_module(module), attribute)
        interval = spec.get("interval_s")
        deployments.append(
            flow.to_deployment(
                name=spec["name"],
                parameters=spec.get("parameters") or {},
                interval=timedelta(seconds=interval) if interval else None,
            )
        )
    serve(*deployments, limit=1)


if __name__ == "__main__":
    main(sys.argv[1])
