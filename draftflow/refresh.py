"""A refresh run's two references to the past: the drafter in service (the champion) and the segments.

A recipe with a ``refresh`` section trains on its newest traffic segment, warm-started from the
champion (the version the destination's release pointer names), evaluates the new drafter (the
challenger) beside the champion, and publishes it only when it wins by the recipe's margins; the
decision is a line of the release history either way (:mod:`draftflow.releases`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from draftflow.data.segments import list_segments
from draftflow.plan import Plan
from draftflow.releases import Releases
from draftflow.remote import local_copy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Champion:
    version: str
    url: str  # the version folder at the destination
    folder: Path  # a local copy (the folder itself on a local destination)


def find_champion(
    plan: Plan, destination_url: str | None, storage_options: dict | None = None
) -> Champion | None:
    """The drafter in service for ``plan``'s recipe at ``destination_url``; None when the recipe has
    no ``refresh`` section, no fsspec destination, or nothing is published there yet. A pointer that
    names an incomplete version raises (:class:`draftflow.releases.ReleaseError`)."""
    if plan.recipe.refresh is None or not destination_url or destination_url.startswith("hf://"):
        return None
    releases = Releases(destination_url, plan.recipe.name, storage_options)
    if releases.pointer() is None:
        log.info("no drafter in service at %s: this run is judged by the usual gate", destination_url)
        return None
    release = releases.current()
    return Champion(release.version, release.url, local_copy(release.url, storage_options))


def segment_details(plan: Plan, storage_options: dict | None = None) -> dict:
    """The run's segment as the release history records it: window and counts (empty without one)."""
    if plan.window is None:
        return {}
    for segment in list_segments(plan.store, plan.recipe.name, storage_options):
        if segment["fingerprint"] == plan.fingerprint:
            return {"window": segment["window"], "counts": segment["counts"], "segment": segment["folder"]}
    return {"window": plan.window.as_dict(), "segment": plan.data.root.rstrip("/").rsplit("/", 1)[-1]}
