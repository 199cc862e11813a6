"""Releases at a publish destination: the current pointer, the history and rollback, on a local
folder and on the loopback S3 (moto); the `draftflow releases` command."""

from __future__ import annotations

import json
import shutil
import uuid

import fsspec
import pytest

from draftflow.cli import main
from draftflow.paths import MODEL_CARD
from draftflow.publish import PUBLISHED_MARKER, Destination, publish
from draftflow.releases import HISTORY_SUFFIX, POINTER_SUFFIX, ReleaseError, Releases, current

RECIPE = "rel-test"  # the name in the recipe of tests/publish/conftest.py's checkpoints


def _state(fs, root: str) -> dict[str, bytes]:
    """Every object under ``root``, with its bytes: what a rollback must leave alone."""
    fs.invalidate_cache()
    return {p: fs.cat_file(p) for p in sorted(fs.find(root))}


def _publish_two_and_roll_back(checkpoint, url: str, options: dict) -> tuple[Releases, list]:
    destination = Destination.parse(url, storage_options=options)
    first = publish(*checkpoint(1), destination)
    second = publish(*checkpoint(2), destination)
    assert first.pushed and second.pushed and first.version != second.version
    assert (first.previous, second.previous) == (None, first.version)
    releases = Releases(url, RECIPE, options)

    assert releases.current().version == second.version
    assert releases.current().url == second.location
    events = releases.history()
    assert [(e["event"], e["version"], e["previous"]) for e in events] == [
        ("published", first.version, None),
        ("published", second.version, first.version),
    ]
    assert events[0]["details"]["tau"] == 1.8 and events[0]["details"]["pushed"] is True
    listed = releases.versions()
    assert [(v.version, v.current) for v in listed] == [(second.version, True), (first.version, False)]
    assert [v.url for v in listed] == [second.location, first.location]

    # The second version's card shows the history as it was when it was published.
    card = releases.fs.cat_file(f"{releases.root}/{RECIPE}-{second.version}/{MODEL_CARD}").decode()
    assert (
        "## Release history" in card and f"| `{first.version}` |" in card and "| published | 1.800 |" in card
    )
    assert (
        "## Release history"
        not in releases.fs.cat_file(f"{releases.root}/{RECIPE}-{first.version}/{MODEL_CARD}").decode()
    )

    # Publishing the current version again writes nothing at all.
    before = _state(releases.fs, releases.root)
    again = publish(*checkpoint(2), destination)
    assert (again.pushed, again.previous) == (False, first.version)
    assert _state(releases.fs, releases.root) == before

    versions = {k: v for k, v in before.items() if "/" + RECIPE + "-" in k}
    back = releases.rollback()
    assert (back.version, back.previous, back.event) == (first.version, second.version, "rolled back")
    assert current(url, RECIPE, options).url == first.location
    assert len(releases.history()) == 3 and releases.history()[-1]["event"] == "rolled back"
    after = _state(releases.fs, releases.root)
    assert {k: v for k, v in after.items() if "/" + RECIPE + "-" in k} == versions  # nothing deleted
    assert [(v.version, v.current) for v in releases.versions()] == [
        (second.version, False),
        (first.version, True),
    ]
    with pytest.raises(ReleaseError, match="no earlier release of rel-test in its history"):
        releases.rollback()  # the first release has nothing before it
    return releases, [first, second]


def _refusals_change_nothing(releases: Releases, versions: list, incomplete: str) -> None:
    before = _state(releases.fs, releases.root)
    for to, match in [
        ("0123456789abcdef", "which does not exist there"),
        (f"{RECIPE}-{incomplete}", f"which has no {PUBLISHED_MARKER} marker: an incomplete push"),
        ("latest", "'latest' is not a version of rel-test"),
    ]:
        with pytest.raises(ReleaseError, match=match):
            releases.rollback(to)
    assert _state(releases.fs, releases.root) == before
    # --to a complete version, named as `releases list` prints it or by its folder
    assert releases.rollback(versions[1].version).version == versions[1].version
    assert releases.rollback(f"{RECIPE}-{versions[0].version}").version == versions[0].version
    assert [e["event"] for e in releases.history()] == ["published"] * 2 + ["rolled back"] * 3


def test_publish_twice_then_roll_back_on_a_local_folder(checkpoint, tmp_path):
    url = str(tmp_path / "published")
    releases, versions = _publish_two_and_roll_back(checkpoint, url, {})
    pointer = json.loads((tmp_path / "published" / f"{RECIPE}{POINTER_SUFFIX}").read_text())
    assert pointer["folder"] == f"{RECIPE}-{versions[0].version}" and pointer["event"] == "rolled back"
    # a copy without its marker: what a push killed before the rename never leaves, made by hand
    incomplete = tmp_path / "published" / f"{RECIPE}-{'f' * 16}"
    shutil.copytree(tmp_path / "export-1", incomplete)
    _refusals_change_nothing(releases, versions, "f" * 16)
    assert sorted(p.name for p in (tmp_path / "published").iterdir()) == sorted(
        [f"{RECIPE}-{v.version}" for v in versions]
        + [incomplete.name, f"{RECIPE}{POINTER_SUFFIX}", f"{RECIPE}{HISTORY_SUFFIX}"]
    )  # no temporary file left behind


def test_a_pointer_to_an_unmarked_version_is_never_served(checkpoint, tmp_path, capsys):
    url = str(tmp_path / "published")
    published = publish(*checkpoint(1), Destination.parse(url))
    folder = tmp_path / "published" / f"{RECIPE}-{published.version}"
    (folder / PUBLISHED_MARKER).rename(tmp_path / "marker")  # as a hand-made or foreign pointer would
    with pytest.raises(ReleaseError, match=f"the current pointer names {RECIPE}-{published.version}, which"):
        current(url, RECIPE)
    assert main(["releases", "current", url, "--recipe", RECIPE]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and "no PUBLISHED marker" in err
    (tmp_path / "marker").rename(folder / PUBLISHED_MARKER)
    assert main(["releases", "current", url, "--recipe", RECIPE]) == 0
    assert capsys.readouterr().out == f"{folder}\n"


def test_the_releases_command(checkpoint, tmp_path, capsys):
    url = str(tmp_path / "published")
    assert main(["releases", "current", url, "--recipe", RECIPE]) == 2
    assert "no current release of rel-test" in capsys.readouterr().err
    first = publish(*checkpoint(1), Destination.parse(url))
    second = publish(*checkpoint(2), Destination.parse(url))

    assert main(["releases", "current", url, "--recipe", RECIPE]) == 0
    assert capsys.readouterr().out == f"{second.location}\n"  # what `vllm serve $(…)` loads
    assert main(["releases", "list", url, "--recipe", RECIPE]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln[:19] for ln in lines] == [f"* {second.version} ", f"  {first.version} "]
    assert lines[0].endswith(f"  {second.location}")

    assert main(["releases", "rollback", url, "--recipe", RECIPE, "--to", "0" * 16]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "does not exist there" in err
    assert main(["releases", "rollback", url, "--recipe", RECIPE]) == 0
    assert capsys.readouterr().out.startswith(f"rolled back: current is {first.location}")
    assert main(["releases", "current", url, "--recipe", RECIPE]) == 0
    assert capsys.readouterr().out == f"{first.location}\n"
    assert main(["releases", "list", "hf://org/drafter", "--recipe", RECIPE]) == 2
    assert "the Hub has its own revisions" in capsys.readouterr().err


@pytest.mark.slow
def test_publish_twice_then_roll_back_on_s3(checkpoint, s3, tmp_path, monkeypatch, capsys):
    url = f"{s3['url']}/releases-{uuid.uuid4().hex[:8]}"
    options = s3["storage_options"]
    releases, versions = _publish_two_and_roll_back(checkpoint, url, options)
    fs, root = fsspec.core.url_to_fs(url, **options)
    incomplete = f"{root}/{RECIPE}-{'e' * 16}"  # files of a push killed before its marker
    fs.put(str(tmp_path / "export-1") + "/", incomplete, recursive=True)
    _refusals_change_nothing(releases, versions, "e" * 16)

    monkeypatch.setenv("DRAFTFLOW_STORAGE_OPTIONS", json.dumps(options))  # credentials, as documented
    assert main(["releases", "current", url, "--recipe", RECIPE]) == 0
    assert capsys.readouterr().out == f"{versions[0].location}\n"
    assert main(["releases", "list", url, "--recipe", RECIPE]) == 0
    assert [ln[:2] for ln in capsys.readouterr().out.splitlines()] == ["  ", "* "]


def test_a_history_line_a_kill_prevented_is_written_by_the_next_change(checkpoint, tmp_path):
    """A kill between the pointer and its history line (the window the kill series rarely hits)."""
    url = str(tmp_path / "published")
    first = publish(*checkpoint(1), Destination.parse(url))
    second = publish(*checkpoint(2), Destination.parse(url))
    history = tmp_path / "published" / f"{RECIPE}{HISTORY_SUFFIX}"
    history.write_text(history.read_text().splitlines(keepends=True)[0])  # the pointer names `second`
    releases = Releases(url, RECIPE)
    releases.record("refused", "c" * 16, {"reason": "challenger slower than the champion"})
    assert releases.current().version == second.version  # a refusal moves nothing

    assert releases.rollback().version == first.version  # the pointer says where it came from
    events = releases.history()
    assert [(e["event"], e["version"]) for e in events] == [
        ("published", first.version),
        ("refused", "c" * 16),
        ("published", second.version),  # recovered from the pointer, with its details
        ("rolled back", first.version),
    ]
    assert events[2]["details"]["tau"] == 1.8 and events[2]["details"]["recovered"] == "from the pointer"
    assert events[2]["time"] < events[3]["time"] and events[3]["previous"] == second.version
