"""Self-generated conversations: the target writes the user turns as well as the replies.

How one conversation is made (attempt ``i`` of a source):

1. The chat template is rendered up to where a user message starts (:func:`user_turn_prefix`),
   after an optional system message: the recipe's ``system_prompt`` and/or the instruction of
   the attempt's topic seed (topics are used round-robin), which steer what the user asks.
2. The target samples the user message from that prefix through the completions endpoint
   (temperature / top-p / max tokens from the recipe, vLLM seed = ``data.seed + i``), stopping
   at end-of-turn. A message that hit max tokens without ending is dropped as truncated.
3. First user turns are cleaned in attempt order (:class:`~draftflow.data.cleaning.PromptCleaner`:
   empty, truncated, degenerate, duplicate, near duplicate), so the kept set depends only on
   the seed; attempts go on in batches until ``num_prompts`` are kept or the attempt budget
   (``num_prompts * max_attempts_ratio``) is spent.
4. For each kept prompt the target writes the reply (the same greedy chat call as response
   regeneration, without the steering system message: replies are on-policy for the prompt
   as a user would send it), then optional follow-up user turns and their replies. A bad
   follow-up ends the conversation there (counted), it does not drop it.

Every finished step is appended to a local JSONL file (one line, flushed and fsynced); a
rerun after a kill reads it and generates only what is missing. A torn last line is ignored.
A pass that fails (no usable prompt or conversation: a misconfigured or wrong server) is not
resumed: its file is moved aside (named in the error) so the next run asks the target afresh.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftflow.async_run import run_pool
from draftflow.data.chat import ChatEncoder
from draftflow.data.cleaning import PromptCleaner, turn_problem
from draftflow.data.regenerate import Generate
from draftflow.data.sources import Conversation
from draftflow.progress import stage
from draftflow.recipe.schema import SelfGeneratedSection

log = logging.getLogger(__name__)

TOPIC_SEEDS = {
    "chat": "The user makes small talk or asks the assistant a casual, friendly question.",
    "coding": "The user asks for help with a programming task: writing, fixing or explaining code.",
    "math": "The user asks a maths question or a word problem that needs step-by-step reasoning.",
    "writing": "The user asks the assistant to write something: a story, a poem, an email or a post.",
    "advice": "The user asks for practical advice about everyday life, work, health or money.",
    "trivia": "The user asks a factual question about history, geography, culture or nature.",
    "summarisation": "The user pastes a short text and asks the assistant to summarise it.",
    "science": "The user asks the assistant to explain a science or technology concept.",
    "howto": "The user asks how to do something, step by step.",
}
_SENTINEL = "DRAFTFLOW-USER-TURN-8c1f"
_SEED_STRIDE_PER_TURN = 1_000_003  # follow-up turn k of attempt i uses seed + i + k * stride
MIN_ATTEMPTS_BEFORE_GIVING_UP = 32


@dataclass
class Sampled:
    """One sampled turn: its text and why sampling stopped ("stop" or "length")."""

    text: str
    finish_reason: str | None


# (prompt token ids, max_tokens, temperature, top_p, seed) -> the sampled continuation
SampleText = Callable[[list[int], int, float, float, int], Awaitable[Sampled]]


class SelfGenerationError(RuntimeError):
    """The target wrote no usable prompt: stop instead of preparing an empty training set."""


class NoUserRole(ValueError):
    """The chat template cannot render a user turn."""


def user_turn_prefix(encoder: ChatEncoder, history: Conversation) -> str:
    """The template's text for ``history`` up to where the next user message's content starts."""
    try:
        text = encoder.render([*history, {"role": "user", "content": _SENTINEL}])
    except Exception as err:  # jinja errors and the template's own raise_exception
        raise NoUserRole(f"the chat template cannot render a user turn: {err}") from None
    at = text.find(_SENTINEL)
    if at < 0:
        raise NoUserRole("the chat template drops the user message: it has no user role")
    return text[:at]


def check_user_role(encoder: ChatEncoder) -> None:
    """Raise NoUserRole unless the template renders user turns (with and without a system message)."""
    user_turn_prefix(encoder, [])
    user_turn_prefix(encoder, [{"role": "system", "content": "x"}])


def steering(settings: SelfGeneratedSection, index: int) -> str | None:
    """The system message that steers attempt ``index`` (None: the template's own default)."""
    parts = [settings.system_prompt] if settings.system_prompt else []
    if settings.topics:
        parts.append(TOPIC_SEEDS[settings.topics[index % len(settings.topics)]])
    return " ".join(parts) or None


@dataclass
class GenerationResult:
    """The kept conversations (attempt order) and what happened, for the prepared report."""

    conversations: list[Conversation]
    attempted: int
    dropped: Counter = field(default_factory=Counter)
    followups_cut: Counter = field(default_factory=Counter)
    resumed: int = 0

    def report(self) -> dict:
        return {
            "attempted": self.attempted,
            "kept": len(self.conversations),
            "dropped": dict(sorted(self.dropped.items())),
            "followups_cut": dict(sorted(self.followups_cut.items())),
            "resumed_from_partial": self.resumed,
        }


class _Partial:
    """The append-only record of finished steps: {"first": i, ...} and {"conversation": i, ...} lines."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.firsts: dict[int, Sampled] = {}
        self.conversations: dict[int, tuple[Conversation | None, str | None, str | None]] = {}
        if self.path.exists():
            text = self.path.read_text(encoding="utf-8")
            if text and not text.endswith("\n"):  # torn by a kill: cut it, or the next line would join it
                text = text[: text.rfind("\n") + 1]
                with open(self.path, "r+", encoding="utf-8") as f:
                    f.truncate(len(text.encode("utf-8")))
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill: that step runs again
                if "first" in record:
                    self.firsts[record["first"]] = Sampled(record["text"], record["finish_reason"])
                elif "conversation" in record:
                    self.conversations[record["conversation"]] = (
                        record["messages"],
                        record["drop"],
                        record["cut"],
                    )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def set_aside(self) -> Path:
        """Move the file out of the way of the next run (kept, under a name no run reads)."""
        aside = self.path.with_name(
            f"{self.path.stem}.failed-{time.strftime('%Y%m%dT%H%M%S')}{self.path.suffix}"
        )
        os.replace(self.path, aside)
        return aside


async def generate_conversations(
    settings: SelfGeneratedSection,
    encoder: ChatEncoder,
    sample: SampleText,
    reply: Generate,
    *,
    seed: int,
    reply_max_tokens: int,
    concurrency: int,
    partial_path: str,
) -> GenerationResult:
    """Generate, clean and resume one self-generated source (see the module docstring)."""
    check_user_role(encoder)
    partial = _Partial(partial_path)
    resumed = len(partial.firsts) + len(partial.conversations)
    try:
        job = _Job(settings, encoder, sample, reply, seed, reply_max_tokens, concurrency, partial)
        return await _generate(job, resumed)
    except SelfGenerationError as err:
        partial.close()
        aside = partial.set_aside()
        raise SelfGenerationError(
            f"{err}. This pass's attempts are in {aside} for inspection; they are not reused, the next "
            "run asks the target afresh"
        ) from None
    finally:
        partial.close()


@dataclass
class _Job:
    """One generation pass: its settings, the target's two endpoints and the partial file."""

    settings: SelfGeneratedSection
    encoder: ChatEncoder
    sample: SampleText
    reply: Generate
    seed: int
    reply_max_tokens: int
    concurrency: int
    partial: _Partial
    control: list[str] = field(init=False)  # the template's: a turn holding one is dropped

    def __post_init__(self):
        self.control = sorted(self.encoder.control_strings)

    async def sample_user(self, i: int, history: Conversation, turn: int) -> Sampled:
        """User turn ``turn`` of attempt ``i``, after ``history``, steered by the attempt's system message."""
        text = steering(self.settings, i)
        system: Conversation = [{"role": "system", "content": text}] if text else []
        prefix = user_turn_prefix(self.encoder, system + history)
        ids = self.encoder.tokenizer(prefix, add_special_tokens=False)["input_ids"]
        request_seed = (self.seed + i + turn * _SEED_STRIDE_PER_TURN) % (1 << 31)
        settings = self.settings
        out = await self.sample(ids, settings.max_tokens, settings.temperature, settings.top_p, request_seed)
        return Sampled(out.text.strip(), out.finish_reason)


@dataclass
class _Prompts:
    """The first user turns judged so far, in attempt order."""

    kept: list[int] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    decided: int = 0  # attempts 0..decided-1 have been judged

    def judge(self, batch: range, firsts: dict[int, Sampled], cleaner: PromptCleaner, wanted: int) -> None:
        """Judge the batch's attempts in order until ``wanted`` prompts are kept."""
        for i in batch:
            if len(self.kept) == wanted:
                break
            s = firsts[i]
            reason = cleaner.check(s.text, s.finish_reason)
            if reason:
                self.dropped[reason] += 1
            else:
                self.kept.append(i)
            self.decided = i + 1


async def _generate(job: _Job, resumed: int) -> GenerationResult:
    """Steps 1-3 of the module docstring (the prompts), then step 4 (their conversations)."""
    prompts = await _first_user_turns(job)
    _check_prompts(job.settings, prompts)
    await _write_conversations(job, prompts.kept)
    conversations: list[Conversation] = []
    cut: Counter = Counter()
    for i in prompts.kept:
        messages, drop, why_cut = job.partial.conversations[i]
        if drop:
            prompts.dropped[drop] += 1
            continue
        if why_cut:
            cut[why_cut] += 1
        conversations.append(messages)
    if not conversations:
        raise SelfGenerationError(
            f"the target wrote no usable conversation: {prompts.decided} prompts tried, all dropped "
            f"({', '.join(f'{k} {v}' for k, v in sorted(prompts.dropped.items()))})"
        )
    return GenerationResult(conversations, prompts.decided, prompts.dropped, cut, resumed)


async def _first_user_turns(job: _Job) -> _Prompts:
    """Sample first user turns in batches, judged in attempt order, until ``num_prompts`` are kept,
    the attempt budget is spent, or a target that writes nothing usable is caught."""
    settings, partial = job.settings, job.partial
    budget = math.ceil(settings.num_prompts * settings.max_attempts_ratio)
    cleaner = PromptCleaner(settings.near_duplicate_threshold, job.control)
    prompts = _Prompts()
    # The total is the attempts scheduled so far, not the whole budget: a budget of 3x the prompts
    # wanted made the bar and its ETA promise three times the work that was usually needed.
    progress = stage("self-generating prompts", None, unit="prompts")

    async def first(i: int) -> None:
        if i not in partial.firsts:
            partial.firsts[i] = await job.sample_user(i, [], 0)
            s = partial.firsts[i]
            partial.append({"first": i, "text": s.text, "finish_reason": s.finish_reason})
        progress.advance()

    try:
        while len(prompts.kept) < settings.num_prompts and prompts.decided < budget:
            size = _batch_size(settings.num_prompts - len(prompts.kept), bool(prompts.kept), job.concurrency)
            batch = range(prompts.decided, min(budget, prompts.decided + size))
            progress.update(total=batch.stop)
            await run_pool(batch, first, job.concurrency)
            prompts.judge(batch, partial.firsts, cleaner, settings.num_prompts)
            if not prompts.kept and prompts.decided >= min(budget, MIN_ATTEMPTS_BEFORE_GIVING_UP):
                break
    finally:
        progress.close()
    return prompts


def _batch_size(wanted: int, any_kept: bool, concurrency: int) -> int:
    """Batch sizes change nothing in the result (attempts are judged in order), only how soon
    a target that writes nothing usable is caught: small batches until one prompt is kept."""
    if any_kept:
        return max(concurrency, math.ceil(wanted * 1.25))
    return max(concurrency, MIN_ATTEMPTS_BEFORE_GIVING_UP)


def _check_prompts(settings: SelfGeneratedSection, prompts: _Prompts) -> None:
    """Stop when no prompt was kept; warn when fewer than asked for were."""
    if not prompts.kept:
        raise SelfGenerationError(
            f"the target wrote no usable prompt: {prompts.decided} tried, {prompts.decided} dropped "
            f"({', '.join(f'{k} {v}' for k, v in sorted(prompts.dropped.items()))}); "
            "check the target's chat template, temperature and max_tokens of the self_generated source"
        )
    if len(prompts.kept) < settings.num_prompts:
        log.warning(
            "self-generated: only %d of %d prompts kept after %d attempts (dropped %s)",
            len(prompts.kept),
            settings.num_prompts,
            prompts.decided,
            dict(prompts.dropped),
        )


async def _write_conversations(job: _Job, kept: list[int]) -> None:
    """The reply and follow-up turns of each kept prompt, recorded in the partial file."""
    partial = job.partial
    progress = stage("self-generating conversations", len(kept), unit="conversations")

    async def conversation(i: int) -> None:
        if i not in partial.conversations:
            partial.conversations[i] = await _converse(job, i, partial.firsts[i].text)
            messages, drop, cut = partial.conversations[i]
            partial.append({"conversation": i, "messages": messages, "drop": drop, "cut": cut})
        progress.advance(failed=int(partial.conversations[i][0] is None))

    try:
        await run_pool(kept, conversation, job.concurrency)
    finally:
        progress.close()


async def _converse(job: _Job, i: int, opener: str) -> tuple[Conversation | None, str | None, str | None]:
    """(messages, why dropped, why cut): a failed first reply drops the conversation, a bad
    follow-up or a failed later reply cuts it before that turn."""
    messages: Conversation = [{"role": "user", "content": opener}]
    for turn in range(job.settings.turns):
        if turn:
            follow = await job.sample_user(i, messages, turn)
            problem = turn_problem(follow.text, follow.finish_reason, job.control)
            if problem:
                return messages, None, problem
            messages.append({"role": "user", "content": follow.text})
        try:
            answer = await job.reply([dict(m) for m in messages], job.reply_max_tokens)
        except Exception as err:  # a server error costs this conversation (or its follow-ups)
            log.warning("self-generated reply to attempt %d failed: %s", i, err)
            if turn:
                return messages[:-1], None, "reply_failed"
            return None, "reply_failed", None
        if not answer.strip():
            if turn:
                return messages[:-1], None, "reply_empty"
            return None, "reply_empty", None
        messages.append({"role": "assistant", "content": answer.strip()})
    return messages, None, None
