"""One JSON line per logging step, to stdout and to the run folder's metrics file.

The orchestrator (a Prefect task) reads the stdout stream; the file stays with the run.
Local files are appended line by line; object stores have no append, so the file is
rewritten whole at every flush (runs log at most a few thousand lines).
"""

from __future__ import annotations

import json
import sys

from draftflow.remote import open_url, url_to_fs

METRIC_PREFIX = "DRAFTFLOW_METRICS "


class MetricsLog:
    def __init__(self, url: str, enabled: bool = True):
        self.url = url
        self.enabled = enabled
        self.lines: list[str] = []
        fs, path = url_to_fs(url)
        self._local = fs.protocol in ("file", "local") or "file" in fs.protocol
        if enabled:
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            if fs.exists(path):  # resumed run: keep the earlier lines
                with fs.open(path, "r") as f:
                    self.lines = [ln.rstrip("\n") for ln in f if ln.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop lines past a resumed checkpoint: those steps are about to run again."""
        kept = [ln for ln in self.lines if json.loads(ln).get("step", 0) <= step]
        if len(kept) != len(self.lines) and self.enabled:
            self.lines = kept
            with open_url(self.url, "w") as f:
                f.write("".join(ln + "\n" for ln in kept))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(record, sort_keys=True)
        self.lines.append(line)
        print(METRIC_PREFIX + line, file=sys.stdout, flush=True)
        if self._local:
            with open_url(self.url, "a") as f:
                f.write(line + "\n")

    def flush(self) -> None:
        if self.enabled and not self._local:
            with open_url(self.url, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def parse_line(line: str) -> dict | None:
    """The orchestrator's side: a metrics record from a line of trainer stdout, or None."""
    if not line.startswith(METRIC_PREFIX):
        return None
    return json.loads(line[len(METRIC_PREFIX) :])
