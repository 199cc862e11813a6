"""The prepared dataset: selected, split, optionally regenerated, tokenised, written as Parquet.

Steps, each deterministic given the sources and ``data.seed``:

1. Read every source (:mod:`draftflow.data.sources`); each conversation gets a content id
   (:func:`sample_id`); exact duplicates, within or across sources, are kept once.
2. Each source keeps the ``max_samples`` conversations with the smallest
   ``sha256(seed:id)``; the union is ordered by a second, independent hash
   ``sha256(mix:seed:id)`` and cut to ``num_samples``. (Reusing the first hash would bias
   the mix: a big source's kept keys are all tiny, so it would fill the eval split and win
   the total cap.) Hash order rather than a shuffled list means selection does not depend
   on file order, and adding a source does not reshuffle the others.
3. The first ``eval_samples`` of that order are the eval split, the rest train. Membership is
   fixed here, before regeneration, so a flaky regeneration can never move a conversation
   between splits; a dropped eval conversation shrinks eval (reported) instead.
4. Optional response regeneration (:mod:`draftflow.data.regenerate`).
5. Tokenisation with the target's template (:mod:`draftflow.data.chat`).
6. Parquet + token counts + a JSON report (:mod:`draftflow.data.dataset`), each written to a
   temporary name and moved into place; the report is written last and marks the folder
   complete, so a crash leaves either nothing or a folder that is redone, never a half-read
   one. A complete folder is reused.

Sample ids hash the *source* conversation (after normalisation, before regeneration), so the
same prompt keeps its id across runs even though regenerated replies may differ.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import heapq
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from draftflow.async_run import run_coroutine
from draftflow.data.chat import ChatEncoder, load_chat_encoder
from draftflow.data.dataset import (  # loaders re-exported (__all__): one import for callers
    EVAL,
    SAMPLES_SCHEMA,
    TOKEN_COUNTS_SCHEMA,
    TRAIN,
    CorruptPreparedData,
    EvalPrompt,
    eval_prompts,
    is_prepared,
    load_prepared,
    load_token_counts,
    loss_token_counts,
    prompt_messages,
    publish_prepared,
    read_report,
    samples_table,
)
from draftflow.data.regenerate import Generate, regenerate_conversations
from draftflow.data.segments import Window
from draftflow.data.self_generated import (
    GenerationResult,
    SampleText,
    generate_conversations,
)
from draftflow.data.sources import Conversation, read_source, source_label
from draftflow.data.traffic import read_traffic
from draftflow.paths import DataLayout
from draftflow.recipe.fingerprint import DATA_FORMAT_VERSION
from draftflow.recipe.load import default_home
from draftflow.recipe.schema import DataSection, Recipe

log = logging.getLogger(__name__)

__all__ = [
    "EVAL",
    "SAMPLES_SCHEMA",
    "TOKEN_COUNTS_SCHEMA",
    "TRAIN",
    "Candidate",
    "CorruptPreparedData",
    "EvalPrompt",
    "Prepared",
    "aprepare",
    "eval_prompts",
    "is_prepared",
    "load_prepared",
    "load_token_counts",
    "loss_token_counts",
    "prepare",
    "prepare_recipe",
    "prompt_messages",
    "read_report",
    "sample_id",
    "select_conversations",
]


def sample_id(messages: Conversation) -> str:
    """Stable content id: first 16 hex digits of sha256 over the canonical JSON of the conversation."""
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _order_key(seed: int, sid: str, stage: str = "") -> str:
    return hashlib.sha256(f"{stage}{seed}:{sid}".encode()).hexdigest()


@dataclass(frozen=True)
class Candidate:
    """A selected conversation, before regeneration and tokenisation."""

    sample_id: str
    source: str
    split: str
    messages: Conversation


@dataclass
class Prepared:
    """Result of :func:`prepare`: where the data is, what happened, and whether it was reused."""

    layout: DataLayout
    report: dict
    reused: bool = False


# ---------------------------------------------------------------------------------------
# Selection and split
# ---------------------------------------------------------------------------------------


def _keyed(
    source_iter: Iterator[Conversation],
    label: str,
    seed: int,
    seen: set[str],
    dropped: Counter,
    usable: Counter,
    earlier: frozenset[str] | set[str] = frozenset(),
) -> Iterator[tuple[str, Candidate]]:
    """(order key, candidate) for each conversation of one source; duplicates counted and skipped
    (``earlier``: ids an earlier data segment kept)."""
    for messages in source_iter:
        usable["usable"] += 1
        sid = sample_id(messages)
        if sid in earlier:
            dropped["seen_in_earlier_segment"] += 1
            continue
        if sid in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(sid)
        yield _order_key(seed, sid), Candidate(sid, label, TRAIN, messages)


def select_conversations(
    data: DataSection,
    generated: dict[int, GenerationResult] | None = None,
    storage_options: dict | None = None,
    *,
    window: Window | None = None,
    earlier: frozenset[str] | set[str] = frozenset(),
) -> tuple[list[Candidate], dict[str, dict]]:
    """Read, dedupe, cap per source and in total, split; returns candidates and per-source stats.

    ``generated`` holds the conversations of the self-generated sources, by source index;
    ``storage_options`` are the store's, used for sources on an object store; ``window`` is the
    run's traffic window (a traffic source needs one); ``earlier``: the sample ids earlier data
    segments kept, dropped here.
    """
    seen: set[str] = set()
    pool: list[tuple[str, Candidate]] = []
    stats: dict[str, dict] = {}
    for index, source in enumerate(data.sources):
        label = source_label(index, source)
        dropped: Counter = Counter()
        usable: Counter = Counter()
        read: Counter = Counter()
        if source.kind == "self_generated":
            if not generated or index not in generated:
                raise ValueError(
                    f"data.sources[{index}]: a self_generated source is written by the target "
                    "during preparation; no sampler was given"
                )
            dropped.update(generated[index].dropped)
            conversations: Iterator[Conversation] = iter(generated[index].conversations)
        elif source.kind == "traffic":
            if window is None:
                raise ValueError(
                    f"data.sources[{index}]: a traffic source is read for a window; none was given"
                )
            conversations = read_traffic(source.traffic, window, dropped, read, storage_options)
        else:
            conversations = read_source(source, dropped, storage_options)
        items = _keyed(conversations, label, data.seed, seen, dropped, usable, earlier)
        if source.max_samples:
            # nsmallest streams the source, holding at most max_samples conversations in memory.
            chosen = heapq.nsmallest(source.max_samples, items, key=lambda kv: kv[0])
        else:
            chosen = list(items)
        pool.extend(chosen)
        stats[label] = {
            "kind": source.kind,
            "usable": usable["usable"],
            "dropped": dict(sorted(dropped.items())),
            "selected": len(chosen),
        }
        if generated and index in generated:
            stats[label]["generation"] = generated[index].report()
        if source.kind == "traffic":
            stats[label]["traffic"] = {"window": window.as_dict(), **dict(sorted(read.items()))}
        log.info(
            "source %s: %d usable, %d selected, dropped %s",
            label,
            usable["usable"],
            len(chosen),
            dict(dropped),
        )
    pool.sort(key=lambda kv: _order_key(data.seed, kv[1].sample_id, "mix:"))
    if data.num_samples is not None:
        pool = pool[: data.num_samples]
    candidates = [
        Candidate(c.sample_id, c.source, EVAL if rank < data.eval_samples else TRAIN, c.messages)
        for rank, (_, c) in enumerate(pool)
    ]
    return candidates, stats


# ---------------------------------------------------------------------------------------
# The whole preparation
# ---------------------------------------------------------------------------------------


@dataclass
class _Tally:
    dropped: Counter = field(default_factory=Counter)
    per_source: dict[str, Counter] = field(default_factory=dict)

    def drop(self, candidate: Candidate, reason: str) -> None:
        self.dropped[reason] += 1
        self.per_source.setdefault(candidate.source, Counter())[f"dropped:{reason}"] += 1


async def aprepare(
    data: DataSection,
    layout: DataLayout,
    encoder: ChatEncoder,
    *,
    generate: Generate | None = None,
    storage_options: dict | None = None,
    regenerate_timeout_s: float | None = None,
    sample: SampleText | None = None,
    local_home: str | None = None,
    window: Window | None = None,
    earlier: frozenset[str] | set[str] = frozenset(),
) -> Prepared:
    """Prepare ``layout``'s samples from ``data``, or reuse them if the folder is complete.

    The async form, for callers that own an event loop (``generate`` and ``sample`` then run
    on that loop, where their HTTP client lives); the blocking parts run in a worker thread.
    Self-generated sources need ``sample`` (user turns) and ``generate`` (replies); their
    partial files go under ``local_home`` when the store is remote. A traffic source reads
    ``window``; ``earlier`` are the sample ids earlier data segments kept (not kept again).
    """
    if await asyncio.to_thread(is_prepared, layout, storage_options):
        log.info("prepared data already in %s: reusing it", layout.prepared_dir)
        return Prepared(layout, await asyncio.to_thread(read_report, layout, storage_options), reused=True)
    if data.regenerate_responses and generate is None:
        raise ValueError("data.regenerate_responses is set but no generate function was given")

    generated = await _self_generate(data, layout, encoder, sample, generate, local_home)
    candidates, source_stats = await asyncio.to_thread(
        functools.partial(select_conversations, window=window, earlier=earlier),
        data,
        generated,
        storage_options,
    )
    outcomes: list[tuple[Conversation | None, str | None]] = [(c.messages, None) for c in candidates]
    regenerate_errors: list[str] = []
    # Self-generated replies are the target's already: regenerating them would only repeat them.
    own = {source_label(i, s) for i, s in enumerate(data.sources) if s.kind == "self_generated"}
    redo = [k for k, c in enumerate(candidates) if c.source not in own]
    if data.regenerate_responses and redo:
        log.info("regenerating %d conversations (concurrency %d)", len(redo), data.regenerate_concurrency)
        redone, regenerate_errors = await regenerate_conversations(
            [candidates[k].messages for k in redo],
            generate,
            data.regenerate_max_tokens,
            data.regenerate_concurrency,
            regenerate_timeout_s,
        )
        for k, outcome in zip(redo, redone):
            outcomes[k] = outcome
    report, wrote = await asyncio.to_thread(
        _encode_and_write,
        data,
        layout,
        encoder,
        candidates,
        outcomes,
        source_stats,
        regenerate_errors,
        storage_options,
    )
    return Prepared(layout, report, reused=not wrote)


async def _self_generate(
    data: DataSection,
    layout: DataLayout,
    encoder: ChatEncoder,
    sample: SampleText | None,
    generate: Generate | None,
    local_home: str | None,
) -> dict[int, GenerationResult]:
    """The conversations of every self-generated source, by source index (resumable)."""
    out: dict[int, GenerationResult] = {}
    for index, source in enumerate(data.sources):
        if source.kind != "self_generated":
            continue
        if sample is None or generate is None:
            raise ValueError(f"data.sources[{index}] is self_generated but no vLLM sampler was given")
        settings = source.generation
        log.info(
            "self-generating %d conversations for data.sources[%d] (concurrency %d)",
            settings.num_prompts,
            index,
            data.regenerate_concurrency,
        )
        out[index] = await generate_conversations(
            settings,
            encoder,
            sample,
            generate,
            seed=data.seed,
            reply_max_tokens=data.regenerate_max_tokens,
            concurrency=data.regenerate_concurrency,
            partial_path=layout.generation_partial(index, local_home or str(default_home())),
        )
        log.info("data.sources[%d] self-generated: %s", index, out[index].report())
    return out


def prepare(
    data: DataSection,
    layout: DataLayout,
    encoder: ChatEncoder,
    *,
    generate: Generate | None = None,
    storage_options: dict | None = None,
    regenerate_timeout_s: float | None = None,
    sample: SampleText | None = None,
    local_home: str | None = None,
    window: Window | None = None,
    earlier: frozenset[str] | set[str] = frozenset(),
) -> Prepared:
    """Blocking :func:`aprepare` (from inside a running loop it runs on a thread of its own)."""
    return run_coroutine(
        aprepare(
            data,
            layout,
            encoder,
            generate=generate,
            storage_options=storage_options,
            regenerate_timeout_s=regenerate_timeout_s,
            sample=sample,
            local_home=local_home,
            window=window,
            earlier=earlier,
        )
    )


def _encode_and_write(
    data: DataSection,
    layout: DataLayout,
    encoder: ChatEncoder,
    candidates: list[Candidate],
    outcomes: list[tuple[Conversation | None, str | None]],
    source_stats: dict[str, dict],
    regenerate_errors: list[str],
    storage_options: dict | None,
) -> dict:
    """Tokenise the surviving conversations, then write samples, token counts and (last) the report."""
    tally = _Tally()
    rows: dict[str, list] = {name: [] for name in SAMPLES_SCHEMA.names}
    totals = Counter()
    for candidate, (messages, reason) in zip(candidates, outcomes):
        encoded = None
        if messages is not None:
            encoded, reason = encoder.encode(messages, data.max_length)
        if encoded is None:
            tally.drop(candidate, reason)
            continue
        totals.update(
            truncated=encoded.truncated,
            context_only=encoded.context_only_turns,
            retokenized=encoded.retokenized_prompts,
        )
        stats = tally.per_source.setdefault(candidate.source, Counter())
        stats[f"kept:{candidate.split}"] += 1
        stats["truncated"] += encoded.truncated
        # Token columns are kept as compact numpy arrays (5 bytes a token instead of ~70 as
        # Python ints): a 100k-sample, 4k-token set must fit in memory.
        for name, value in (
            ("sample_id", candidate.sample_id),
            ("split", candidate.split),
            ("input_ids", np.asarray(encoded.input_ids, dtype=np.int32)),
            ("loss_mask", np.asarray(encoded.loss_mask, dtype=np.uint8)),
            ("num_tokens", len(encoded.input_ids)),
            ("num_loss_tokens", encoded.num_loss_tokens),
            ("source", candidate.source),
            ("messages", json.dumps(messages, ensure_ascii=False)),
        ):
            rows[name].append(value)

    split_counts = Counter(rows["split"])
    if not split_counts[TRAIN]:
        raise ValueError(
            f"no training samples left ({len(candidates)} selected, {split_counts[EVAL]} eval, "
            f"dropped {dict(tally.dropped)}): add data or lower data.eval_samples"
        )
    train_rows = [i for i, s in enumerate(rows["split"]) if s == TRAIN]
    counts = loss_token_counts(
        [rows["input_ids"][i] for i in train_rows], [rows["loss_mask"][i] for i in train_rows]
    )

    for label, stats in source_stats.items():
        extra = tally.per_source.get(label, Counter())
        stats["kept"] = {TRAIN: extra[f"kept:{TRAIN}"], EVAL: extra[f"kept:{EVAL}"]}
        stats["truncated"] = extra["truncated"]
        stats["dropped_after_selection"] = {
            k.removeprefix("dropped:"): v for k, v in sorted(extra.items()) if k.startswith("dropped:")
        }
    report = {
        "format": DATA_FORMAT_VERSION,
        "seed": data.seed,
        "max_length": data.max_length,
        "regenerated": data.regenerate_responses,
        "self_generated": {k: v["generation"] for k, v in source_stats.items() if "generation" in v},
        "selected": len(candidates),
        "kept": {TRAIN: split_counts[TRAIN], EVAL: split_counts[EVAL]},
        "eval_requested": data.eval_samples,
        "dropped": dict(sorted(tally.dropped.items())),
        "truncated": totals["truncated"],
        "context_only_assistant_turns": totals["context_only"],
        "retokenized_prompts": totals["retokenized"],
        "tokens": {
            TRAIN: int(sum(rows["num_tokens"][i] for i in train_rows)),
            "train_loss": int(sum(rows["num_loss_tokens"][i] for i in train_rows)),
            "total": int(sum(rows["num_tokens"])),
        },
        "sources": source_stats,
        "regenerate_errors": regenerate_errors,
    }
    counts_table = pa.table(
        {"token_id": list(counts), "count": list(counts.values())}, schema=TOKEN_COUNTS_SCHEMA
    )
    # Written once: another preparation on this fingerprint may have finished meanwhile (its
    # extraction reads those files), then its report is returned and nothing is rewritten.
    report, wrote = publish_prepared(layout, samples_table(rows), counts_table, report, storage_options)
    if wrote:
        log.info(
            "prepared %s train / %s eval samples in %s",
            split_counts[TRAIN],
            split_counts[EVAL],
            layout.prepared_dir,
        )
    else:
        log.warning("%s was prepared by another run meanwhile: using its files", layout.prepared_dir)
    return report, wrote


def prepare_recipe(
    recipe: Recipe,
    layout: DataLayout,
    *,
    generate: Generate | None = None,
    storage_options: dict | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> Prepared:
    """:func:`prepare` for a recipe: loads the target's tokenizer only when there is work to do."""
    if is_prepared(layout, storage_options):
        return Prepared(layout, read_report(layout, storage_options), reused=True)
    encoder = load_chat_encoder(recipe.target, template_kwargs)
    return prepare(
        recipe.data,
        layout,
        encoder,
        generate=generate,
        storage_options=storage_options,
        regenerate_timeout_s=recipe.extraction.request_timeout_s,
    )
