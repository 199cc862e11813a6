"""Conversations → token ids + loss mask, with the target's own chat template.

The loss mask is 1 exactly on the tokens the target itself emits in an assistant turn: from
the end of the generation prompt up to and including the stop token (``<|im_end|>`` for
ChatML). Template glue after the stop token (ChatML's trailing newline) stays 0: the model
never generates it, generation stops at the stop token.

How the spans are found (no regexes, so any template works):

- The whole conversation is rendered and tokenised once (with character offsets); that
  token sequence is the sample.
- For each assistant turn ``i``: ``before`` = the conversation up to the turn rendered with
  ``add_generation_prompt=True`` (what a server feeds the target to produce the turn);
  ``after`` = the conversation up to and including the turn.
- ``before`` must be a prefix of the full rendering, or the full text puts the context in a
  form the target never sees when it produces the turn: the conversation is dropped
  (``template_prefix_mismatch``).
- The turn's tokens start at the token that starts where ``before`` ends; a token straddling
  that point (a template whose prompt ends in a space that BPE merges into the reply) drops
  the conversation (``token_boundary_mismatch``). They end at the first stop token before the
  end of ``after`` (or at its end for templates without one).
- The token prefix property is checked as well: ``tokenize(before)`` should equal the sample's
  tokens up to the turn. Where it does not (a GPT-2-style pre-tokeniser splits the "\n\n"
  that ends a Qwen3 non-thinking prompt differently once the reply follows), the masked
  tokens are still exactly the reply's tokens and only the context differs from what a server
  would send; the turn is kept and counted (``retokenized_prompts``).
- If ``after`` is *not* a prefix, the template rewrites this turn once later turns follow.
  Qwen3-style templates do this: the ``<think>…</think>`` block of an assistant turn is
  removed from every turn before the last user message. Decision: such a turn stays in the
  sample as context (mask 0) and is counted (``context_only_turns``). Its history form is not
  what the target emitted when it produced the turn (it emitted the reasoning too), so
  training the drafter on it would teach a distribution the target never produces. The turns
  after the final user message always keep their mask; conversations where no turn keeps any
  mask are dropped (``no_loss_tokens``).

Truncation keeps the first ``max_length`` tokens (counted); a sample left without loss tokens
is dropped (``no_loss_after_truncation``). Turns that start beyond the cut are not rendered at
all: prefix rendering is quadratic in the number of turns, and long chat logs have hundreds.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from draftflow.data.sources import Conversation
from draftflow.recipe.load import expand
from draftflow.recipe.schema import TargetSection


@dataclass(frozen=True)
class Encoded:
    """One tokenised conversation."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    context_only_turns: int  # assistant turns kept as context because the template rewrites them
    retokenized_prompts: int  # turns whose context tokens differ from tokenize(generation prompt)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


class ChatEncoder:
    """Renders conversations with one tokenizer + chat template and derives assistant loss masks."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        stop_token_ids: Iterable[int] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat template and the recipe sets no target.chat_template")
        if not isinstance(template, str):
            raise ValueError("named chat templates (dict) are not supported; set target.chat_template")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "a fast tokenizer (tokenizer.json) is needed: loss masks use its character offsets"
            )
        stops = set(stop_token_ids or ())
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        if not stops:
            raise ValueError("no stop token: the tokenizer has no eos token and none was given")
        self.stop_token_ids = frozenset(stops)
        # Strings that the tokenizer turns into control tokens wherever they appear. In message
        # text they would forge turn boundaries (a user writing "<|im_end|>"), so such
        # conversations are dropped rather than silently mis-tokenised.
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.control_strings = frozenset(
            s
            for s in (
                list(getattr(tokenizer, "all_special_tokens", []))
                + [
                    t.content
                    for t in added.values()
                    if getattr(t, "special", False) and t.content in template
                ]
            )
            if s
        )

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (the target's template or the recipe's override)."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        # add_special_tokens=False like apply_chat_template: the template writes BOS itself.
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def encode(
        self, messages: Conversation, max_length: int | None = None
    ) -> tuple[Encoded | None, str | None]:
        """(Encoded, None), or (None, drop reason) for a conversation that cannot be used."""
        if any(s in m["content"] for m in messages for s in self.control_strings):
            return None, "control_token_in_content"
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            return None, "no_assistant_turn"
        try:
            full_text = self.render(messages)
        except Exception:  # jinja errors and templates' own raise_exception (role order etc.)
            return None, "template_error"
        encoding = self.tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
        truncated = max_length is not None and len(ids) > max_length
        if truncated:
            ids, offsets = ids[:max_length], offsets[:max_length]
        kept_chars = offsets[-1][1] if truncated else len(full_text)
        starts = [start for start, _ in offsets]
        ends_before = [0]  # ends_before[j]: furthest character any of the first j tokens covers
        for _, end in offsets:
            ends_before.append(max(ends_before[-1], end))

        mask = [0] * len(ids)
        context_only = 0
        checked: list[tuple[str, int]] = []  # (generation prompt, index of the turn's first token)
        for i in turns:
            try:
                before_text = self.render(messages[:i], add_generation_prompt=True)
                after_text = self.render(messages[: i + 1])
            except Exception:
                return None, "template_error"
            if not full_text.startswith(before_text):
                return None, "template_prefix_mismatch"
            if len(before_text) >= kept_chars:
                break  # this turn and every later one lie beyond the truncation point
            if not full_text.startswith(after_text):
                context_only += 1
                continue
            first = bisect_left(starts, len(before_text))
            if ends_before[first] > len(before_text):
                return None, "token_boundary_mismatch"
            last = bisect_left(starts, len(after_text))
            for pos in range(first, last):
                if ids[pos] in self.stop_token_ids:
                    last = pos + 1
                    break
            mask[first:last] = [1] * (last - first)
            checked.append((before_text, first))

        if not any(mask):
            return None, "no_loss_after_truncation" if truncated else "no_loss_tokens"
        prompts = self._tokenize([text for text, _ in checked])
        retokenized = sum(ids[:first] != prompt for (_, first), prompt in zip(checked, prompts))
        return Encoded(ids, mask, truncated, context_only, retokenized), None

    def prompt_ids(self, messages: Conversation) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (what a server would feed)."""
        return self._tokenize([self.render(messages, add_generation_prompt=True)])[0]


def read_chat_template(url: str) -> str:
    """Text of a Jinja chat template file (local path or fsspec URL; ``${VAR}`` expanded)."""
    with fsspec.open(expand(url), "r", encoding="utf-8") as f:
        return f.read()


def generation_stop_ids(model: str, revision: str | None = None) -> list[int]:
    """The target's stop ids from its generation config (Llama 3 and Gemma list several;
    Gemma's turn end ``<end_of_turn>`` is not the tokenizer's eos). Empty when there is none."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(expand(model), revision=revision).eos_token_id
    except (OSError, ValueError):  # no generation_config.json (or offline without a cached copy)
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def load_chat_encoder(target: TargetSection, template_kwargs: dict[str, Any] | None = None) -> ChatEncoder:
    """The encoder for a recipe target: its tokenizer, optional template override and stop ids."""
    from transformers import AutoTokenizer

    model = expand(target.model)
    tokenizer = AutoTokenizer.from_pretrained(model, revision=target.revision)
    template = read_chat_template(target.chat_template) if target.chat_template else None
    return ChatEncoder(tokenizer, template, generation_stop_ids(model, target.revision), template_kwargs)
