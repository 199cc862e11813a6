"""A refresh's decision at publishing: a challenger that does not beat the drafter in service is
refused, that one is kept (the pointer does not move) and the history says why; a winner is
published with both drafters' figures and the segment's window and counts in its history line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftflow.evaluation.report import Evaluation
from draftflow.publish import Destination, PublishRefused, publish
from draftflow.releases import Releases

RECIPE = "rel-test"
MARGINS = {"acceptance": 0.05, "speedup": 0.0}
SEGMENT = {"window": {"since": "2026-12-01T00:00:00+00:00", "until": "2026-12-02T00:00:00+00:00"}}


def raced(report: Path, *, tau: float, speedup: float, champion: dict | None) -> Path:
    """``report`` rewritten as a refresh's evaluation: vLLM τ and speed-up, the champion beside it."""
    data = json.loads(report.read_text())
    evaluation = Evaluation.from_dict(data)
    drafts = evaluation.offline.drafts
    accepted = round((tau - 1.0) * drafts)
    for source in ("offline", "vllm"):
        data[source] = dict(data["offline"], source=source, accepted_tokens=accepted)
        data[source]["accepted_per_position"] = [min(accepted, drafts), max(accepted - drafts, 0), 0]
    data["vllm"]["throughput"] = {
        "with_drafter_tok_s": 40.0 * speedup,
        "without_drafter_tok_s": 40.0,
        "speedup": speedup,
        "rounds": [speedup],
        **({"champion": champion} if champion else {}),
    }
    data["champion_margins"] = MARGINS
    data["meta"]["champion"] = champion["version"] if champion else None
    report.write_text(json.dumps(data))
    return report


def champion_of(version: str, tau: float, speedup: float) -> dict:
    return {
        "version": version,
        "tau": tau,
        "settings": {"version": version},
        "tok_s": 40.0 * speedup,
        "speedup": speedup,
        "rounds": [speedup],
        "outputs_identical": 4,
        "prompts": 4,
    }


def in_service(checkpoint, tmp_path: Path):
    """A destination with checkpoint 1 published (nothing was in service: the usual gate)."""
    url = str(tmp_path / "dest")
    destination = Destination.parse(url)
    return url, destination, publish(*checkpoint(1), destination)


def test_a_challenger_that_does_not_win_is_refused_and_the_champion_kept(checkpoint, tmp_path):
    url = str(tmp_path / "dest")
    destination = Destination.parse(url)
    first = publish(*checkpoint(1), destination)  # nothing in service yet: the usual gate
    releases = Releases(url, RECIPE)
    pointer = (Path(url) / f"{RECIPE}.current.json").read_bytes()

    folder, report = checkpoint(2)
    close = champion_of(first.version, tau=1.80, speedup=1.20)
    kept = publish(folder, raced(report, tau=1.8, speedup=1.25, champion=close), destination, history=SEGMENT)
    assert (kept.location, kept.pushed, kept.kept) == (None, False, first.version)
    assert "does not beat the champion's" in kept.reasons[0] and "min_gain_acceptance 0.05" in kept.reasons[0]
    assert (Path(url) / f"{RECIPE}.current.json").read_bytes() == pointer
    assert releases.current().version == first.version
    assert [v.version for v in releases.versions()] == [first.version]  # nothing of it was pushed
    refused = releases.history()[-1]
    assert (refused["event"], refused["previous"]) == ("refused", first.version)
    assert refused["details"]["champion"] == {"version": first.version, "tau": 1.8, "speedup": 1.2}
    assert refused["details"]["tau"] == 1.8 and refused["details"]["speedup"] == 1.25
    assert refused["details"]["window"] == SEGMENT["window"] and "gate failed" in refused["details"]["reason"]

    folder, report = checkpoint(3)
    slower = champion_of(first.version, tau=1.5, speedup=1.4)
    kept = publish(folder, raced(report, tau=1.8, speedup=1.3, champion=slower), destination)
    assert kept.kept == first.version and "speed-up 1.30x does not beat the champion's" in kept.reasons[0]

    folder, report = checkpoint(4)
    beaten = champion_of(first.version, tau=1.5, speedup=1.1)
    won = publish(folder, raced(report, tau=1.8, speedup=1.3, champion=beaten), destination, history=SEGMENT)
    assert won.pushed and won.kept is None and won.previous == first.version
    assert releases.current().version == won.version
    line = releases.history()[-1]
    assert line["event"] == "published" and line["details"]["champion"]["tau"] == 1.5
    assert line["details"]["window"] == SEGMENT["window"]

    # The winner's card shows the history with the refusals and the champion's figures, and a chart.
    version = Path(url) / f"{RECIPE}-{won.version}"
    card = (version / "README.md").read_text()
    assert "| refused | 1.800 | 1.25x | 1.800 | 1.20x | 2026-12-02T00:00 |" in card
    assert "![τ of each release event](release-history.png)" in card
    assert (version / "release-history.png").read_bytes().startswith(b"\x89PNG")


def test_a_first_refresh_that_fails_the_usual_gate_raises_and_is_recorded(checkpoint, tmp_path):
    url = str(tmp_path / "dest")
    folder, report = checkpoint(1)
    with pytest.raises(PublishRefused, match="gate failed"):
        publish(folder, raced(report, tau=1.01, speedup=1.2, champion=None), Destination.parse(url))
    (line,) = Releases(url, RECIPE).history()
    assert line["event"] == "refused" and line["previous"] is None and "champion" not in line["details"]
    assert Releases(url, RECIPE).pointer() is None


def test_a_report_raced_beside_another_drafter_than_the_one_in_service_is_refused(checkpoint, tmp_path):
    url = str(tmp_path / "dest")
    destination = Destination.parse(url)
    first = publish(*checkpoint(1), destination)
    second = publish(*checkpoint(2), destination)  # a concurrent publish moved the pointer since
    pointer = (Path(url) / f"{RECIPE}.current.json").read_bytes()
    history = Releases(url, RECIPE).history()
    stale = champion_of(first.version, tau=1.2, speedup=1.0)
    for champion, measured in ((stale, f"beside {first.version}"), (None, "without the drafter in service")):
        folder, report = checkpoint(3)
        with pytest.raises(PublishRefused) as refused:
            publish(folder, raced(report, tau=1.9, speedup=1.5, champion=champion), destination)
        message = str(refused.value)
        assert f"in service at {url} is {second.version}" in message and measured in message
        assert message.endswith(
            "draftflow evaluate --champion) so it races the current one; nothing was pushed"
        )
        assert (Path(url) / f"{RECIPE}.current.json").read_bytes() == pointer
        assert Releases(url, RECIPE).history() == history  # no line: nothing was decided


def test_a_refresh_refused_for_other_bytes_raises_instead_of_keeping_the_champion(checkpoint, tmp_path):
    url, destination, first = in_service(checkpoint, tmp_path)
    folder, report = checkpoint(2)
    raced(report, tau=1.0, speedup=0.9, champion=champion_of(first.version, tau=1.8, speedup=1.2))
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")  # not what was measured
    with pytest.raises(PublishRefused, match="the report measured other bytes"):
        publish(folder, report, destination)
    assert [line["event"] for line in Releases(url, RECIPE).history()] == ["published"]


def test_publishing_the_same_refused_report_again_adds_no_history_line(checkpoint, tmp_path):
    url, destination, first = in_service(checkpoint, tmp_path)
    folder, report = checkpoint(2)
    raced(report, tau=1.8, speedup=1.2, champion=champion_of(first.version, tau=1.8, speedup=1.2))
    for _ in range(2):
        assert publish(folder, report, destination, history=SEGMENT).kept == first.version
    assert [line["event"] for line in Releases(url, RECIPE).history()] == ["published", "refused"]
