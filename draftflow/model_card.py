"""The model card (README.md) of a published drafter, written for the person who finds it on the Hub.

It names the verifier as the world knows it (a hub id where the recipe has one, never the
training machine's path), gives the serve command for the *published* copy, the acceptance
table and chart, the training data, budget and fingerprints. Nothing in it is a local path
of the machine that trained or evaluated the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from huggingface_hub import ModelCardData

from draftflow.evaluation.report import AcceptanceReport, Evaluation, rounds_text
from draftflow.evaluation.speed import speed_table
from draftflow.recipe.schema import Recipe

CHART_FILE = "acceptance.png"
HISTORY_CHART_FILE = "release-history.png"  # τ of each release event (draftflow.releases)
HISTORY_ROWS = 10  # the newest release events the card shows


@dataclass(frozen=True)
class Verifier:
    name: str  # hub id, or the folder name of a local copy
    is_hub_id: bool
    revision: str | None = None


def verifier_of(recipe: Recipe) -> Verifier:
    """The recipe's target as a reader can look it up: its hub id, else the name of its folder."""
    model = recipe.target.model
    local = model.startswith(("/", "~", ".", "$")) or "${" in model or Path(model).is_dir()
    if local:
        return Verifier(PurePosixPath(model.rstrip("/")).name, False)
    return Verifier(model, True, recipe.target.revision)


def serve_command(
    location: str, verifier: Verifier, kind: str, speculative_tokens: int, folder_name: str
) -> str:
    """What to type to serve the published copy at ``location`` (its verifier resolved by vLLM)."""
    if location.startswith("hf://"):
        lines, where = [], location.removeprefix("hf://")
    elif "://" in location and not location.startswith("file://"):
        protocol = location.split("://", 1)[0]
        lines = [
            "# copy the folder first (vLLM reads local folders and hub repos), e.g. with fsspec:",
            f"python -c \"import fsspec; fsspec.filesystem('{protocol}').get('{location}', "
            f"'{folder_name}', recursive=True)\"",
        ]
        where = f"./{folder_name}"
    else:
        lines, where = [], location.removeprefix("file://")
    if verifier.is_hub_id:
        lines.append(f"vllm serve {where}")
    else:  # config.json names the verifier by the trainer's path: pass it explicitly
        spec = json.dumps({"model": where, "method": kind, "num_speculative_tokens": speculative_tokens})
        lines += [
            f"# the verifier was a local folder when trained: point at your copy of {verifier.name}",
            f"vllm serve ./{verifier.name} --speculative-config '{spec}'",
        ]
    return "\n".join(lines)


def hub_metadata(recipe: Recipe, verifier: Verifier, kind: str) -> str:
    """The card's YAML front matter, which the Hub reads: the verifier as `base_model` (a hub id
    only: a local folder's name would link to an unrelated repo), the format's library, tags and
    the recipe's license."""
    data = ModelCardData(
        base_model=verifier.name if verifier.is_hub_id else None,
        library_name="speculators",
        license=recipe.publish.license,
        pipeline_tag="text-generation",
        tags=["speculative-decoding", kind, "draftflow"],
    )
    return f"---\n{data.to_yaml()}\n---"


def _acceptance_table(reports: list[AcceptanceReport]) -> list[str]:
    k = max((r.draft_length for r in reports), default=0)
    lines = [
        "| measured in | prompts | drafts | τ (mean acceptance length) | acceptance rate | "
        + " | ".join(f"position {i + 1}" for i in range(k))
        + " |",
        "|" + "---|" * (5 + k),
    ]
    for r in reports:
        where = "vLLM" if r.source == "vllm" else "offline simulator"
        lines.append(
            f"| {where} | {r.num_prompts} | {r.drafts} | "
            f"{r.mean_acceptance_length:.3f} | {r.acceptance_rate:.3f} | "
            + " | ".join(f"{p:.3f}" for p in r.per_position)
            + " |"
        )
    return lines


def _verdict(evaluation: Evaluation) -> list[str]:
    lines = []
    vllm = evaluation.vllm
    if vllm and vllm.throughput:
        t = vllm.throughput
        lines.append(
            f"- decode speed in vLLM (batch 1): {t['with_drafter_tok_s']:.1f} tok/s with the "
            "drafter, "
            f"{t['without_drafter_tok_s']:.1f} without (speedup {t['speedup']:.2f}x{rounds_text(t)})"
        )
    for r in (evaluation.offline, vllm):
        if r and r.outputs_identical is not None:
            lines.append(
                f"- {r.source}: {r.outputs_identical}/{r.num_prompts} outputs identical to the "
                "verifier's own greedy output"
            )
    if evaluation.relative_gap is not None:
        lines.append(
            f"- offline vs vLLM τ gap {evaluation.relative_gap:.1%} "
            f"(tolerance {evaluation.agreement_tolerance:.1%})"
        )
    lines.append(
        f"- gate passed: τ {evaluation.tau:.3f} (at least {evaluation.min_acceptance_length:.3f} required)"
    )
    speedup, note = evaluation.speedup, evaluation.speed_gate_note()
    if note:
        lines.append(f"- {note}")
    elif speedup is not None and evaluation.min_speedup is not None:
        lines.append(
            f"- gate passed: speed-up {speedup:.2f}x over the verifier alone (at least "
            f"{evaluation.min_speedup:.2f}x required)"
        )
    for name in evaluation.must_beat if speedup is not None else []:
        other = evaluation.baselines.get(name)
        if other is not None:
            verb = "beats" if speedup > other["speedup"] else "does not beat"
            lines.append(
                f"- {verb} {name} (train-free speculation, {other['speedup']:.2f}x) in the same runs"
            )
    return lines


def _speed(evaluation: Evaluation) -> list[str]:
    """The decode-speed table: the verifier alone, each train-free baseline, the drafter."""
    throughput = evaluation.vllm.throughput if evaluation.vllm else None
    if not throughput:
        return []
    return [
        "## Decode speed",
        "",
        "Greedy decoding in vLLM at batch size 1, each side on the same prompts in the same rounds "
        "(completion tokens / request time, pooled over the rounds).",
        "",
        *speed_table(throughput, evaluation.meta.get("prompt_categories")),
        "",
    ]


def _training(recipe: Recipe, provenance: dict, recipe_text: str) -> list[str]:
    data, training, drafter = recipe.data, recipe.training, recipe.drafter
    size = provenance.get("draft_vocab_size")
    vocab = f"draft vocabulary of {size} tokens" if size else "the verifier's full vocabulary"
    sources = ", ".join(
        s.kind
        + (f" `{PurePosixPath(s.path.rstrip('/')).name}`" if s.path else "")
        + (f" (≤ {s.max_samples} conversations)" if s.max_samples else "")
        for s in data.sources
    )
    return [
        f"- data: {sources}; samples up to {data.max_length} tokens, {data.eval_samples} held out "
        "for evaluation",
        f"- budget: {training.epochs} epoch(s), packs of {training.pack_length} tokens × "
        f"{training.batch_size} per process per step, lr {training.lr:g} ({training.schedule}), "
        f"loss `{training.loss}`",
        f"- drafter: `{drafter.kind}`, {provenance.get('speculative_tokens')} speculative tokens, "
        f"reads verifier layers {provenance.get('aux_layer_ids')}, {vocab}",
        f"- data fingerprint `{provenance.get('fingerprint')}`; recipe fingerprint "
        f"`{hashlib.sha256(recipe_text.encode()).hexdigest()[:16]}` (sha256 of `recipe.yaml` in this folder)",
    ]


def _number(value, form: str) -> str:
    return form.format(value) if isinstance(value, int | float) else "–"


def _history_table(history: list[dict], chart: bool = False) -> list[str]:
    """The newest events of the destination's release history (``draftflow.releases``); a refresh's
    lines carry the drafter in service it raced (champion) and its traffic window."""
    lines = [
        "## Release history",
        "",
        "Earlier events of this recipe at the destination when this version was published, newest "
        "first (`draftflow releases list` shows which version is current now).",
        "",
        "| version | date (UTC) | event | τ | speed-up | champion τ | champion speed-up | traffic until |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for event in history[-HISTORY_ROWS:][::-1]:
        details = event.get("details") or {}
        champion = details.get("champion") or {}
        until = str((details.get("window") or {}).get("until") or "–")[:16]
        lines.append(
            f"| `{event.get('version') or '–'}` | {str(event.get('time', ''))[:10]} | {event.get('event')} | "
            f"{_number(details.get('tau'), '{:.3f}')} | {_number(details.get('speedup'), '{:.2f}x')} | "
            f"{_number(champion.get('tau'), '{:.3f}')} | {_number(champion.get('speedup'), '{:.2f}x')} | {until} |"
        )
    if chart:
        lines += ["", f"![τ of each release event]({HISTORY_CHART_FILE})"]
    return [*lines, ""]


def history_chart(history: list[dict], path: str | Path) -> bool:
    """τ of each release event with one (published, promoted, refused…), and the champion's τ it was
    raced against, as a PNG at ``path``; False (nothing written) when no event has a τ."""
    from matplotlib.figure import Figure  # not pyplot: drawn in task threads (see train/curves.py)

    events = [
        e for e in history[-HISTORY_ROWS:] if isinstance((e.get("details") or {}).get("tau"), int | float)
    ]
    if not events:
        return False
    fig = Figure(figsize=(7, 3.2), dpi=100)
    ax = fig.add_subplot()
    xs = list(range(len(events)))
    taus = [e["details"]["tau"] for e in events]
    ax.plot(xs, taus, color="tab:blue", label="τ (this drafter)")
    for x, event, tau in zip(xs, events, taus):
        refused = event.get("event") == "refused"
        ax.scatter([x], [tau], marker="x" if refused else "o", color="tab:red" if refused else "tab:blue")
    champions = [(x, (e["details"].get("champion") or {}).get("tau")) for x, e in zip(xs, events)]
    champions = [(x, t) for x, t in champions if isinstance(t, int | float)]
    if champions:
        ax.scatter(*zip(*champions), marker="_", s=200, color="tab:gray", label="τ of the drafter in service")
    ax.set_xticks(xs, [str(e.get("version") or "")[:6] for e in events], rotation=45, fontsize=7)
    ax.set_ylabel("mean acceptance length τ")
    ax.set_title("Release history (x: refused)")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    return True


def render(
    *,
    recipe: Recipe,
    recipe_text: str,
    provenance: dict,
    evaluation: Evaluation,
    location: str,
    folder_name: str,
    chart: bool,
    history: list[dict] | None = None,
    history_chart: bool = False,
) -> str:
    """The card's Markdown for the checkpoint published at ``location``; ``history``: the release
    events at its destination so far (none: no history section)."""
    verifier = verifier_of(recipe)
    kind, k = provenance["drafter"], int(provenance["speculative_tokens"])
    shown = f"`{verifier.name}`" + (f" (revision `{verifier.revision}`)" if verifier.revision else "")
    if not verifier.is_hub_id:
        shown += " (a local copy when trained; the recipe names no hub id)"
    reports = [r for r in (evaluation.offline, evaluation.vllm) if r]
    lines = [
        hub_metadata(recipe, verifier, kind),
        f"# {recipe.name}: a {kind} drafter for {verifier.name}",
        "",
        f"A speculative-decoding drafter ({kind}, {k} draft tokens per step) for the verifier {shown}, "
        "trained with draftflow. The folder is in the speculators format that vLLM serves.",
        "",
        "## Serve it",
        "",
        "```bash",
        serve_command(location, verifier, kind, k, folder_name),
        "```",
        "",
        "## Acceptance",
        "",
        f"Greedy decoding of {reports[0].num_prompts if reports else 0} held-out prompts; τ counts the "
        "tokens produced per verifier forward pass (1 = no speed-up).",
        "",
        *_acceptance_table(reports),
        "",
        *_verdict(evaluation),
        "",
        *_speed(evaluation),
    ]
    if chart:
        lines += [f"![Per-position acceptance]({CHART_FILE})", ""]
    lines += [
        "## Training",
        "",
        *_training(recipe, provenance, recipe_text),
        "",
        "`recipe.yaml` (the resolved recipe), `train_command.txt` and `provenance.json` in this folder "
        "record how it was made.",
        "",
    ]
    if history:
        lines += _history_table(history, history_chart)
    return "\n".join(lines)
