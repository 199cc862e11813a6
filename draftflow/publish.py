"""Publishing a checkpoint: refuse what was not measured or did not pass, write the card, push once.

:func:`publish` is the one entry point (the ``draftflow publish`` command and the Prefect task
both call it). It refuses, pushing nothing, when

- the evaluation report is about other bytes than the folder holds (``report.json`` records the
  checkpoint's digest, :func:`draftflow.models.speculators.checkpoint_digest`);
- the report is not ``publishable``: gate failed, offline and vLLM disagree, or the contract
  check found problems; or the contract check fails now.

A published version is named by the content hash of the folder (its card aside), so pushing the
same checkpoint twice writes nothing the second time. fsspec destinations get the files first
and a ``PUBLISHED`` marker last (a reader trusts only marked versions; a local version folder
appears by one rename, complete with its marker). Then the recipe's release pointer names the
version and the release history gets a line (:mod:`draftflow.releases`). The Hugging Face Hub
path uploads one commit into a repository created **private** unless the destination says
otherwise, and skips the upload when the Hub already holds that version; it keeps no pointer
(the Hub has its own revisions).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import fsspec
import yaml
from fsspec.implementations.local import LocalFileSystem

from draftflow.evaluation.contract import check_contract
from draftflow.evaluation.report import Evaluation
from draftflow.model_card import CHART_FILE, HISTORY_CHART_FILE, history_chart, render
from draftflow.models.provenance import read_provenance
from draftflow.models.speculators import checkpoint_digest
from draftflow.paths import EXPORT_RECIPE, MODEL_CARD, join
from draftflow.recipe.load import expand, recipe_from_dict
from draftflow.recipe.schema import Recipe
from draftflow.releases import PUBLISHED_MARKER, Releases, marker_bytes
from draftflow.remote import is_remote, local_copy

log = logging.getLogger(__name__)
VERSION_FILE = "draftflow-version.json"
# the card names the version, so it cannot be part of it; the history chart changes with each event
_NOT_VERSIONED = (VERSION_FILE, MODEL_CARD, HISTORY_CHART_FILE)


class PublishRefused(RuntimeError):
    """The checkpoint may not be published (nothing was pushed); the message says why."""


class GateFailed(PublishRefused):
    """The report's gate failed (``failures``: one line per reason, as the message joins them)."""

    def __init__(self, failures: list[str]):
        super().__init__(f"gate failed: {'; '.join(failures)}; nothing was pushed")
        self.failures = failures


@dataclass(frozen=True)
class Destination:
    """Where to publish: an fsspec folder URL (one sub-folder per version) or ``hf://OWNER/REPO``.

    ``hf://OWNER/REPO?private=false`` (or ``private=False``) creates a public Hub repository;
    by default it is private.
    """

    url: str
    storage_options: dict = field(default_factory=dict, repr=False)
    hf_token: str | None = field(default=None, repr=False)
    private: bool = True

    @classmethod
    def parse(
        cls,
        url: str,
        *,
        storage_options: dict | None = None,
        hf_token: str | None = None,
        private: bool = True,
    ) -> Destination:
        """``private``: for a new Hub repository, unless the URL's ``?private=`` says otherwise."""
        parts = urlsplit(url)
        if parts.scheme != "hf":
            return cls(expand(url), dict(storage_options or {}), hf_token, private)
        query = parse_qs(parts.query)
        if "private" in query:
            flag = query["private"][-1].lower()
            if flag not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{url}: private={flag!r} is neither true nor false")
            private = flag in ("true", "1", "yes")
        return cls(parts._replace(query="").geturl(), {}, hf_token, private)

    @property
    def hub_repo(self) -> str | None:
        return self.url.removeprefix("hf://") if self.url.startswith("hf://") else None


@dataclass(frozen=True)
class Published:
    location: str | None  # None: no destination, nothing pushed
    version: str
    pushed: bool  # False when that exact version was already there
    previous: str | None = None  # the version the release pointer named before (fsspec destinations)
    kept: str | None = None  # a refresh that did not beat the drafter in service: its version, kept
    reasons: list[str] = field(default_factory=list)  # why it was kept

    def as_dict(self) -> dict:
        return asdict(self)


def folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in _NOT_VERSIONED):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def check_publishable(checkpoint: Path, evaluation: Evaluation, target_info=None) -> None:
    """Raise :class:`PublishRefused` unless ``evaluation`` measured exactly this folder and passed."""
    digest = checkpoint_digest(checkpoint)
    if evaluation.checkpoint_digest is None:
        raise PublishRefused(
            f"the report records no checkpoint digest, so it cannot be tied to "
            f"{checkpoint}: evaluate the checkpoint again; nothing was pushed"
        )
    if evaluation.checkpoint_digest != digest:
        raise PublishRefused(
            f"the report measured other bytes (checkpoint sha256 "
            f"{evaluation.checkpoint_digest[:12]}…) than {checkpoint} holds "
            f"({digest[:12]}…): evaluate this checkpoint; nothing was pushed"
        )
    failures = evaluation.gate_failures()  # τ, then the speed-up (when measured) and its baselines
    if failures:
        raise GateFailed(failures)
    if not evaluation.agrees:
        raise PublishRefused(f"{evaluation.disagreement()}; nothing was pushed")
    problems = list(evaluation.contract_problems) or check_contract(checkpoint, target_info)
    if problems:
        raise PublishRefused("checkpoint contract broken; nothing was pushed:\n- " + "\n- ".join(problems))


def publish(
    checkpoint: str | Path,
    report: str | Path,
    destination: Destination | None,
    *,
    target_info=None,
    recipe: Recipe | None = None,
    storage_options: dict | None = None,
    history: dict | None = None,
) -> Published:
    """Check, write the model card (and chart) into ``checkpoint``, push it to ``destination``.

    ``report``: the ``report.json`` of the evaluation of this checkpoint (its ``acceptance.png``
    beside it goes into the folder). ``target_info``: the verifier's sizes, for a fuller contract
    check. ``recipe``: used when the folder has no ``recipe.yaml`` (the trainer writes one).
    ``destination`` None: check and write the card, push nothing. An fsspec destination's release
    pointer then names the version (``Published.previous``: the one it named before). A remote ``checkpoint`` or
    ``report`` (a run folder on s3://) is read through a local copy, with ``storage_options`` (None:
    the environment's); the card is written into that copy, never into the run folder.

    A refresh run (the report carries champion margins) at an fsspec destination records its
    decision in the release history (``history``: the segment's window and counts, added to the
    line). When it does not beat the drafter in service, that one is kept: nothing is pushed, the
    pointer stays, and the result says why (``kept``, ``reasons``) instead of raising.
    """
    folder = local_copy(checkpoint, storage_options)
    report = _local_report(str(report), storage_options)
    evaluation = Evaluation.from_dict(json.loads(report.read_text()))
    refresh = evaluation.champion_margins is not None and destination is not None and not destination.hub_repo
    if refresh:
        releases = Releases(destination.url, _recipe(folder, recipe)[0].name, destination.storage_options)
        _check_raced_current(evaluation, releases)
    try:
        check_publishable(folder, evaluation, target_info)
    except GateFailed as refused:
        if not refresh:
            raise
        _record_refused(releases, folder_digest(folder), evaluation, history, str(refused))
        champion = evaluation.champion
        if champion is None:
            raise  # a first refresh, nothing in service: the usual gate failed
        log.warning("kept the drafter in service (%s): %s", champion["version"], refused)
        return Published(None, folder_digest(folder), False, kept=champion["version"], reasons=[str(refused)])
    chart = report.with_name(CHART_FILE)
    if chart.is_file():
        (folder / CHART_FILE).write_bytes(chart.read_bytes())
    recipe, recipe_text = _recipe(folder, recipe)
    version = folder_digest(folder)
    name = f"{recipe.name}-{version}"
    location, releases = None, None  # releases: the pointer and history of an fsspec destination
    if destination is not None and destination.hub_repo:
        location = f"hf://{destination.hub_repo}"
    elif destination is not None:
        location = join(destination.url, name)
        releases = Releases(destination.url, recipe.name, destination.storage_options)
    events = releases.history() if releases else None
    charted = bool(events) and history_chart(events, folder / HISTORY_CHART_FILE)
    card = render(
        recipe=recipe,
        recipe_text=recipe_text,
        provenance=read_provenance(folder) or {},
        evaluation=evaluation,
        location=location or str(folder),
        folder_name=name,
        chart=chart.is_file(),
        history=events,
        history_chart=charted,
    )
    (folder / MODEL_CARD).write_text(card)
    if destination is None:
        return Published(None, version, pushed=False)
    if releases is None:
        return push_hub(folder, destination.hub_repo, destination.hf_token, private=destination.private)
    published = push_fsspec(folder, destination.url, recipe.name, destination.storage_options)
    details = {**_release_details(evaluation, published.pushed), **(history or {})}
    release = releases.promote(version, details=details)
    return replace(published, previous=release.previous)


def _check_raced_current(evaluation: Evaluation, releases: Releases) -> None:
    """A refresh publishes only over the drafter it was raced against: refuse a report measured
    beside another version (or none) than the one the pointer names now."""
    pointer = releases.pointer()
    raced = evaluation.meta.get("champion")
    if pointer is not None and raced != pointer.version:
        against = f"beside {raced}" if raced else "without the drafter in service beside it"
        raise PublishRefused(
            f"the drafter in service at {releases.dest} is {pointer.version}, but this report measured "
            f"the checkpoint {against}: evaluate it again (draftflow evaluate --champion) so it races "
            "the current one; nothing was pushed"
        )


def _record_refused(
    releases: Releases, version: str, evaluation: Evaluation, history: dict | None, reason: str
) -> None:
    """One ``refused`` line per version and reason: publishing the same report again adds none."""
    last = (releases.history() or [{}])[-1]
    if last.get("event") == "refused" and last.get("version") == version:
        if last.get("details", {}).get("reason") == reason:
            return
    details = {**_release_details(evaluation, False), **(history or {}), "reason": reason}
    releases.record("refused", version, details=details)


def _release_details(evaluation: Evaluation, pushed: bool) -> dict:
    """What the history line of a publication records about the version."""
    details = {"tau": round(evaluation.tau, 4), "min_acceptance_length": evaluation.min_acceptance_length}
    for report in (evaluation.offline, evaluation.vllm):
        if report:
            details[f"{report.source}_tau"] = round(report.mean_acceptance_length, 4)
    throughput = evaluation.vllm.throughput if evaluation.vllm else None
    if throughput and "speedup" in throughput:
        details["speedup"] = round(throughput["speedup"], 4)
    champion = evaluation.champion
    if champion is not None:
        details["champion"] = {
            "version": champion["version"],
            "tau": round(champion["tau"], 4),
            "speedup": round(champion["speedup"], 4),
        }
    return {**details, "pushed": pushed}


def _local_report(report: str, storage_options: dict | None) -> Path:
    """report.json as a local file; a remote one comes with its folder (the chart beside it)."""
    if not is_remote(report):
        return Path(report.removeprefix("file://"))
    folder, _, name = report.rstrip("/").rpartition("/")
    return local_copy(folder, storage_options) / name


def _recipe(folder: Path, fallback: Recipe | None) -> tuple[Recipe, str]:
    path = folder / EXPORT_RECIPE
    if path.is_file():
        text = path.read_text()
        return recipe_from_dict(yaml.safe_load(text), str(path)), text
    if fallback is None:
        raise PublishRefused(
            f"{folder} has no {EXPORT_RECIPE} (the trainer's export writes one) and no "
            "recipe was given: the model card cannot say how it was trained; nothing was "
            "pushed"
        )
    return fallback, yaml.safe_dump(json.loads(fallback.model_dump_json()), sort_keys=False)


def push_fsspec(folder: Path, dest_url: str, name: str, storage_options: dict | None = None) -> Published:
    """Copy ``folder`` to ``DEST/NAME-VERSION`` so that no reader sees a part of it as a version.

    Object stores: every file, then the ``PUBLISHED`` marker (a reader trusts only marked
    versions; a rerun after a kill uploads again and marks). Local folders: the copy and its
    marker go into a hidden sibling that is renamed into place whole, so the version's folder
    exists only complete; hidden siblings of killed runs of this version are removed first.
    """
    version = folder_digest(folder)
    target = join(dest_url, f"{name}-{version}")
    fs, root = fsspec.core.url_to_fs(target, **(storage_options or {}))
    marker = f"{root}/{PUBLISHED_MARKER}"
    if fs.exists(marker):
        return Published(target, version, pushed=False)
    if isinstance(fs, LocalFileSystem):
        _publish_local(folder, Path(root), version)
        return Published(target, version, pushed=True)
    fs.makedirs(root, exist_ok=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path), f"{root}/{rel}")
    with fs.open(marker, "wb") as f:
        f.write(marker_bytes(version))
    return Published(target, version, pushed=True)


def _publish_local(folder: Path, final: Path, version: str) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{final.name}.partial-"
    for stale in final.parent.glob(prefix + "*"):  # this version's copies that a kill interrupted
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():  # unmarked: left by a publish that wrote in place; kept, moved aside
        aside = final.with_name(f".{final.name}.incomplete-{secrets.token_hex(4)}")
        os.replace(final, aside)
        log.warning("moved an incomplete copy of %s aside to %s", final, aside)
    tmp = final.with_name(prefix + secrets.token_hex(6))
    try:
        shutil.copytree(folder, tmp)
        (tmp / PUBLISHED_MARKER).write_bytes(marker_bytes(version))
        _fsync_tree(tmp)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """Every file and folder under ``root`` on disk before the rename makes it a version."""
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def push_hub(folder: Path, repo_id: str, token: str | None, *, private: bool = True, api=None) -> Published:
    """Upload to the Hub unless its newest commit already carries this version; a new repository
    is created private unless ``private`` is False (an existing one keeps its visibility)."""
    from huggingface_hub import HfApi, hf_hub_download  # only the Hub path needs it

    api = api or HfApi(token=token)
    version = folder_digest(folder)
    api.create_repo(repo_id, exist_ok=True, private=private, token=token)
    try:
        current = json.loads(Path(hf_hub_download(repo_id, VERSION_FILE, token=token)).read_text())
    except Exception:  # no such file yet (new repo), or not readable: upload
        current = {}
    location = f"hf://{repo_id}"
    if current.get("version") == version:
        return Published(location, version, pushed=False)
    (folder / VERSION_FILE).write_text(json.dumps({"version": version}))
    api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        token=token,
        commit_message=f"draftflow checkpoint {version}",
    )
    return Published(location, version, pushed=True)
