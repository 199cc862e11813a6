"""The project's own evaluation prompt set: shape, no overlap with training data, τ per category."""

from __future__ import annotations

import json
import struct
from collections import Counter

import pytest

# fixtures: a prepared recipe and a known-behaviour drafter
from test_evaluate_command import checkpoint, recipe  # noqa: F401

from draftflow.data.sources import load_source
from draftflow.evaluation import categories
from draftflow.evaluation.report import AcceptanceReport, Evaluation, PromptAcceptance
from draftflow.plan import Plan
from draftflow.recipe.catalog import resolve
from draftflow.recipe.schema import DataSource

CATEGORIES = {"chat", "how-to", "coding", "maths-reasoning", "writing-summarisation", "copy-heavy"}


def test_the_set_has_78_distinct_prompts_in_6_categories_and_a_separate_tuning_split():
    prompts = categories.load_prompt_set("draftflow-eval")
    counts = Counter(p.category for p in prompts)
    assert len(prompts) == 78 and counts == {c: 13 for c in CATEGORIES}
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert len({categories.normalise(p.text) for p in prompts}) == len(prompts)
    sample = categories.load_prompt_set("draftflow-eval", per_category=2)
    assert Counter(p.category for p in sample) == {c: 2 for c in CATEGORIES}
    assert [p.prompt_id for p in sample][:2] == [
        p.prompt_id for p in prompts if p.category == sample[0].category
    ][:2]
    with pytest.raises(ValueError, match="evaluation.prompt_set"):
        categories.load_prompt_set("nope")
    # the tuning split: every category, and no prompt of the measured set, not even nearly
    tune = categories.load_prompt_set("draftflow-tune")
    assert Counter(p.category for p in tune) == {c: 2 for c in CATEGORIES}
    assert not {p.prompt_id for p in tune} & {p.prompt_id for p in prompts}
    assert not set().union(*(_shingles(p.text, 6) for p in tune)) & set().union(
        *(_shingles(p.text, 6) for p in prompts)
    )


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = categories.normalise(text).split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@pytest.mark.slow
def test_no_eval_prompt_appears_in_the_training_sources():
    """Every conversation the pip-shipped sources hold (a superset of any prepared training set drawn
    from them), and the demo recipe's selected training conversations: no eval prompt equal after
    normalisation, and no 8-word run shared with any turn."""
    eval_prompts = categories.load_prompt_set("draftflow-eval") + categories.load_prompt_set("draftflow-tune")
    eval_norm = {categories.normalise(p.text) for p in eval_prompts}
    eval_shingles = set().union(*(_shingles(p.text) for p in eval_prompts))
    turns = []
    for kind in ("chatterbot", "chitchat"):
        conversations, _ = load_source(DataSource(kind=kind))
        turns += [m["content"] for conv in conversations for m in conv]
    from draftflow.data.prepare import select_conversations

    demo = Plan.load(str(resolve("smollm2-135m-dflash-cpu")))
    candidates, _ = select_conversations(demo.recipe.data)
    demo_turns = [m["content"] for c in candidates for m in c.messages]
    assert len(turns) > 10_000 and demo_turns
    assert not eval_norm & {categories.normalise(t) for t in turns + demo_turns}
    shared = [t for t in turns + demo_turns if _shingles(t) & eval_shingles]
    assert not shared, shared[:3]


def _report(source: str, rows: list[tuple[str, int, int, list[int]]]) -> AcceptanceReport:
    per_prompt = [PromptAcceptance(name, d, a, 16, 3 * d, pos) for name, d, a, pos in rows]
    return AcceptanceReport(
        source,
        "dflash",
        3,
        len(rows),
        sum(r[1] for r in rows),
        3 * sum(r[1] for r in rows),
        sum(r[2] for r in rows),
        [sum(r[3][i] for r in rows) for i in range(3)],
        per_prompt,
    )


def test_tau_per_category_pools_drafts_like_the_overall_tau(tmp_path):
    rows = [("chat-01", 10, 5, [3, 1, 1]), ("chat-02", 6, 0, [0, 0, 0]), ("coding-01", 4, 8, [4, 3, 1])]
    cats = {"chat-01": "chat", "chat-02": "chat", "coding-01": "coding"}
    ev = Evaluation(
        _report("offline", rows),
        _report("vllm", rows[:2] + [("coding-01", 4, 4, [3, 1, 0])]),
        1.0,
        0.5,
        "/ckpt",
        meta={"prompt_set": "draftflow-eval", "prompt_categories": cats},
    )
    table = ev.to_dict()["per_category"]
    assert table["offline"]["chat"]["tau"] == pytest.approx(1 + 5 / 16)
    assert table["offline"]["chat"]["per_position"] == pytest.approx([3 / 16, 1 / 16, 1 / 16])
    assert table["offline"]["coding"]["tau"] == 3.0 and table["vllm"]["coding"]["tau"] == 2.0
    md = ev.markdown()
    assert "| chat | 2 | 1.312 | 1.312 |" in md and "| coding | 1 | 3.000 | 2.000 |" in md
    assert "prompt_categories" not in md.split("\n")[2]  # the mapping is not dumped into the header line
    back = Evaluation.from_dict(json.loads(json.dumps(ev.to_dict())))
    assert back.to_dict()["per_category"] == table
    png = ev.write(tmp_path)["chart"].read_bytes()
    assert struct.unpack(">II", png[16:24]) == (1100, 350)  # per-position panel + per-category panel


@pytest.mark.slow
def test_evaluate_reports_tau_per_category_on_the_prompt_set(recipe, checkpoint, tmp_path):  # noqa: F811
    from draftflow.cli import main

    code = main(
        [
            "evaluate",
            str(checkpoint),
            "--recipe",
            recipe.recipe_path,
            "--no-vllm",
            "--out",
            str(tmp_path),
            "--set",
            "evaluation.prompt_set=draftflow-eval",
            "--set",
            "evaluation.prompts_per_category=1",
        ]
    )
    assert code in (0, 1)
    data = json.loads((tmp_path / "report.json").read_text())
    expected = [p.prompt_id for p in categories.load_prompt_set("draftflow-eval", per_category=1)]
    assert data["meta"]["prompt_ids"] == expected and data["meta"]["prompt_set"] == "draftflow-eval"
    table = data["per_category"]["offline"]
    assert set(table) == CATEGORIES and all(row["prompts"] == 1 for row in table.values())
    by_id = {p["prompt_id"]: p for p in data["offline"]["per_prompt"]}
    for p in categories.load_prompt_set("draftflow-eval", per_category=1):
        assert table[p.category]["drafts"] == by_id[p.prompt_id]["drafts"] > 0
    assert sum(r["accepted"] for r in table.values()) == data["offline"]["accepted_tokens"]
    assert "τ per prompt category (draftflow-eval)" in (tmp_path / "report.md").read_text()
