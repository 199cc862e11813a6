"""Conversations → token ids + loss mask, with the target's own chat template.

The loss mask is 1 exactly on the tokens the target itself emits in an assistant turn: from
the end of the generation prompt up to and including the stop token (``<|im_end|>`` for
ChatML). Template glue after the stop token (ChatML's trailing newline) stays 0: the model
never generates it, generation stops at the stop token.

How the spans are found (no regexes, so any template works):

- The whole conversation is rendered once; that token sequence is the sample.
- For each assistant turn ``i``: ``before`` = the conversation up to the turn, rendered with
  ``add_generation_prompt=True`` (exactly what a server feeds the target to produce the
  turn); ``after`` = the conversation up to and including the turn.
- ``before`` must be a token prefix of the full sequence, or the full rendering puts the
  context in a form the target never sees at generation time: the conversation is dropped
  (``template_prefix_mismatch``).
- If ``after`` is a token prefix too, the turn's tokens are ``full[len(before):len(after)]``,
  cut after the first stop token.
- If ``after`` is *not* a prefix, the template rewrites this turn once later turns follow.
  Qwen3-style templates do this: the ``<think>…</think>`` block of an assistant turn is
  removed from every turn before the last user message. Decision: such a turn stays in the
  sample as context (mask 0) and is counted (``context_only_turns``). Its history form is not
  what the target emitted when it produced the turn (it emitted the reasoning too), so
  training the drafter on it would teach a distribution the target never produces; the last
  turns after the final user message always keep their mask. Conversations where no turn
  keeps any mask are dropped (``no_loss_tokens``).

Truncation keeps the first ``max_length`` tokens (counted); a sample left without loss tokens
is dropped (``no_loss_after_truncation``).
"""

from __future__ import annotations

import json
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
            s for s in (
                list(getattr(tokenizer, "all_special_tokens", []))
                + [t.content for t in added.values() if getattr(t, "special", False) and t.content in template]
            ) if s
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

    def encode(self, messages: Conversation, max_length: int | None = None) -> tuple[Encoded | None, str | None]:
        """(Encoded, None), or (None, drop reason) for a conversation that cannot be used."""
        if any(s in m["content"] for m in messages for s in self.control_strings):
            return None, "control_token_in_content"
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            return None, "no_assistant_turn"
        try:
            full_text = self.render(messages)
            before_texts = [self.render(messages[:i], add_generation_prompt=True) for i in turns]
            after_texts = [self.render(messages[: i + 1]) for i in turns]
        except Exception:  # jinja errors and templates' own raise_exception (role order etc.)
            return None, "template_error"

        # Token prefixes imply text prefixes, so texts that are not even a text prefix are
        # settled without tokenising them (the common case for Qwen3-style history turns).
        candidates = [t for t in before_texts + after_texts if full_text.startswith(t)]
        token_lists = self._tokenize([full_text, *candidates])
        full_ids, prefix_ids = token_lists[0], dict(zip(candidates, token_lists[1:]))

        mask = [0] * len(full_ids)
        context_only = 0
        for before_text, after_text in zip(before_texts, after_texts):
            before = prefix_ids.get(before_text)
            if before is None or full_ids[: len(before)] != before:
                return None, "template_prefix_mismatch"
            after = prefix_ids.get(after_text)
            if after is None or len(after) <= len(before) or full_ids[: len(after)] != after:
                context_only += 1
                continue
            start, end = len(before), len(after)
            for pos in range(start, end):
                if full_ids[pos] in self.stop_token_ids:
                    end = pos + 1
                    break
            mask[start:end] = [1] * (end - start)

        if not any(mask):
            return None, "no_loss_tokens"
        truncated = max_length is not None and len(full_ids) > max_length
        if truncated:
            full_ids, mask = full_ids[:max_length], mask[:max_length]
            if not any(mask):
                return None, "no_loss_after_truncation"
        return Encoded(list(full_ids), mask, truncated, context_only), None

    def prompt_ids(self, messages: Conversation) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (what a server would feed)."""
        return self._tokenize([self.render(messages, add_generation_prompt=True)])[0]


def read_chat_template(url: str) -> str:
    """Text of a Jinja chat template file (local path or fsspec URL; ``${VAR}`` expanded)."""
    with fsspec.open(expand(url), "r", encoding="utf-8") as f:
        return f.read()


def generation_stop_ids(model_dir: str) -> list[int]:
    """Stop ids from a local model folder's generation_config.json (Llama 3 lists several)."""
    try:
        with fsspec.open(expand(model_dir).rstrip("/") + "/generation_config.json", "r") as f:
            eos = json.load(f).get("eos_token_id")
    except (FileNotFoundError, json.JSONDecodeError, OSError):
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
    return ChatEncoder(tokenizer, template, generation_stop_ids(model), template_kwargs)
