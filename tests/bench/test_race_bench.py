"""bench/race.py's bookkeeping: groups within a category, pooled speeds and τ, the tables."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def race(bench_module):
    return bench_module("race")


def test_groups_stay_within_a_category_in_file_order(race):
    names = ["a1", "a2", "a3", "b1", "b2", "a4"]
    categories = {"a1": "a", "a2": "a", "a3": "a", "b1": "b", "b2": "b", "a4": "a"}
    ids = [[i] for i in range(len(names))]
    groups = race.groups_of(names, ids, categories, 2)
    assert [(g.category, g.names) for g in groups] == [
        ("a", ["a1", "a2"]),
        ("a", ["a3"]),
        ("b", ["b1", "b2"]),
        ("a", ["a4"]),
    ]
    assert groups[2].ids == [[3], [4]]
    assert [g.names for g in race.groups_of(names, ids, categories, 1)] == [[n] for n in names]


def test_speeds_pool_tokens_over_time_and_tau_pools_drafts(race):
    D = race.Decoded
    # two rounds; the target decodes 10 tokens a second, the side 20 then 10: pooled 15/s over 2 s
    target = [[D("chat", {"p": [1] * 10}, 1.0), D("code", {"q": [2] * 10}, 1.0)] for _ in range(2)]
    side = [
        [D("chat", {"p": [1] * 10}, 0.25, drafts=4, accepted=6), D("code", {"q": [2] * 10}, 0.75, 6, 2)],
        [D("chat", {"p": [1] * 10}, 1.0, 10, 0), D("code", {"q": [9] * 10}, 1.0, 10, 0)],
    ]
    rows = race.summarise({race.TARGET: target, "drafter": side})
    r = rows["drafter"]
    assert r["tok_s"] == pytest.approx(40 / 3.0) and r["speedup"] == pytest.approx((40 / 3.0) / 10)
    assert r["speedup_rounds"] == pytest.approx([2.0, 1.0])
    assert r["tau"] == pytest.approx(1 + 8 / 30) and r["drafts"] == 30
    assert r["per_category"]["chat"] == pytest.approx({"tau": 1 + 6 / 14, "speedup": 20 / 1.25 / 10})
    assert r["per_category"]["code"]["speedup"] == pytest.approx(20 / 1.75 / 10)
    assert (r["identical"], r["outputs"]) == (3, 4)  # round 2's code output differs from the target's
    assert rows[race.TARGET]["tau"] is None and rows[race.TARGET]["speedup"] == 1.0


def test_the_table_names_every_side_and_says_why_one_did_not_run(race):
    D = race.Decoded
    results = {
        race.TARGET: [[D("chat", {"p": [1] * 4}, 1.0)]],
        "n-gram": [[D("chat", {"p": [1] * 4}, 0.5, 2, 2)]],
    }
    sides = [
        race.Side(race.TARGET, "t", None),
        race.Side(
            "n-gram", "t", race.ngram_config(3, (2, 4)), race.settings_text(race.ngram_config(3, (2, 4)))
        ),
    ]
    lines = race.markdown({"batch 1": race.summarise(results)}, sides, {"suffix": "arctic_inference missing"})
    text = "\n".join(lines)
    assert (
        "| n-gram | num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4 | 2.00 | 8.0 | **2.00x**"
        in text
    )
    assert "| suffix | not run: arctic_inference missing |" in text
    assert "| n-gram | 2.00 / 2.00x |" in text


def test_drafters_are_named_and_read_from_the_callers_folder(race, bench_args, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = bench_args(race, "--drafter", "quality=runs/q/export", "--drafter", "demo=d@x/export@2")
    assert args.drafter == [
        ("quality", str(tmp_path / "runs/q/export"), None),
        ("demo", str(tmp_path / "d@x/export"), 2),
    ]
    with pytest.raises(SystemExit):
        bench_args(race, "--drafter", "no-name-given")
