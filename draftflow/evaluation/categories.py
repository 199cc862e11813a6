"""The project's own evaluation prompt set, and acceptance per prompt category.

``draftflow-eval`` (``draftflow/evaluation/prompt_sets/draftflow-eval.jsonl``): 78 single-turn
prompts written for this project (not taken from any dataset), 13 in each of six
categories: chat, how-to, coding, maths-reasoning, writing-summarisation and copy-heavy (the
prompt holds a text or code the answer copies with edits: where prompt-lookup speculation is
strong). No data source reads it, so it is never trained on (a test checks it shares no prompt
with the training sources). A recipe selects it with ``evaluation.prompt_set: draftflow-eval``;
``evaluation.prompts_per_category`` takes the first N of each category (a fast sample).

``draftflow-tune``: 12 more prompts, two per category, for tuning what is measured on
``draftflow-eval`` (``bench/race.py`` picks the n-gram settings on it), never on it.

τ per category pools the drafts of the category's prompts exactly as the overall τ pools
all of them (1 + accepted / drafts), from the per-prompt counts of the offline and the vLLM
reports, so the two stay comparable category by category.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from draftflow.paths import prompt_set_file

PROMPT_SETS = ("draftflow-eval", "draftflow-tune")


@dataclass(frozen=True)
class EvalPrompt:
    prompt_id: str
    category: str
    text: str

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.text}]


def load_prompt_set(name: str, per_category: int | None = None) -> list[EvalPrompt]:
    """The set's prompts in file order; with ``per_category``, the first N of each category."""
    if name not in PROMPT_SETS:
        known = ", ".join(PROMPT_SETS)
        raise ValueError(f"evaluation.prompt_set: unknown prompt set {name!r} (known: {known})")
    prompts, taken = [], {}
    with open(prompt_set_file(name), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = EvalPrompt(row["id"], row["category"], row["prompt"])
            if per_category is not None and taken.get(prompt.category, 0) >= per_category:
                continue
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            prompts.append(prompt)
    return prompts


def normalise(text: str) -> str:
    """Lower case, letters and digits only, single spaces: what counts as 'the same prompt'."""
    return " ".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def per_category(report, categories: dict[str, str]) -> dict[str, dict]:
    """{category: prompts, drafts, accepted, tau, per_position} from an AcceptanceReport's prompts."""
    k = report.draft_length
    out: dict[str, dict] = {}
    for p in report.per_prompt:
        cat = categories.get(p.prompt_id)
        if cat is None:
            continue
        empty = {"prompts": 0, "drafts": 0, "accepted": 0, "accepted_per_position": [0] * k}
        row = out.setdefault(cat, empty)
        row["prompts"] += 1
        row["drafts"] += p.drafts
        row["accepted"] += p.accepted
        per_pos = p.accepted_per_position or [0] * k
        row["accepted_per_position"] = [a + b for a, b in zip(row["accepted_per_position"], per_pos)]
    for row in out.values():
        d = row["drafts"]
        row["tau"] = 1.0 + row["accepted"] / d if d else 1.0
        row["per_position"] = [a / d if d else 0.0 for a in row["accepted_per_position"]]
    return dict(sorted(out.items()))


def evaluation_categories(evaluation) -> dict[str, dict[str, dict]]:
    """{source ("offline" / "vllm"): per_category(...)} for an Evaluation with prompt categories."""
    categories = evaluation.meta.get("prompt_categories") or {}
    if not categories:
        return {}
    return {r.source: per_category(r, categories) for r in (evaluation.offline, evaluation.vllm) if r}


def category_markdown(evaluation) -> list[str]:
    """The per-category τ table (one column per evaluator), or nothing without categories."""
    table = evaluation_categories(evaluation)
    if not table:
        return []
    sources = list(table)
    cats = sorted({c for rows in table.values() for c in rows})
    lines = [
        "",
        f"τ per prompt category ({evaluation.meta.get('prompt_set', 'prompt set')}):",
        "",
        "| category | prompts | " + " | ".join(f"{s} τ" for s in sources) + " |",
        "|---|---|" + "---|" * len(sources),
    ]
    for cat in cats:
        n = next(rows[cat]["prompts"] for rows in table.values() if cat in rows)
        cells = [f"{table[s][cat]['tau']:.3f}" if cat in table[s] else "" for s in sources]
        lines.append(f"| {cat} | {n} | " + " | ".join(cells) + " |")
    return lines


def draw_categories(ax, evaluation) -> bool:
    """Bars of τ per category and evaluator on ``ax``; False when there are no categories."""
    table = evaluation_categories(evaluation)
    if not table:
        return False
    cats = sorted({c for rows in table.values() for c in rows})
    width = 0.8 / len(table)
    for j, (source, rows) in enumerate(table.items()):
        xs = [i + (j - (len(table) - 1) / 2) * width for i in range(len(cats))]
        heights = [rows[c]["tau"] - 1.0 if c in rows else 0.0 for c in cats]
        ax.bar(xs, heights, width=width, bottom=1.0, label=source)
    ax.set_xticks(range(len(cats)), cats, rotation=20, fontsize=8)
    ax.set_ylabel("τ")
    ax.set_ylim(bottom=1.0)
    ax.set_title("τ per prompt category")
    ax.legend()
    return True


def category_names(prompts: Sequence[EvalPrompt]) -> dict[str, str]:
    return {p.prompt_id: p.category for p in prompts}
