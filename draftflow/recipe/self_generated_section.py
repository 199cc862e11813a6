"""The settings of a `self_generated` source: the target writes the user turns through vLLM."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, FiniteFloat

from draftflow.recipe.section import MAX_COUNT, MAX_TOKENS, Section

# Topic seeds a self-generated source may steer towards (the instruction for each lives in
# draftflow.data.self_generated); a fixed set, so a typo is a validation error.
Topic = Literal["chat", "coding", "math", "writing", "advice", "trivia", "summarisation", "science", "howto"]


class SelfGeneratedSection(Section):
    """How the target writes its own user turns (``kind: self_generated``)."""

    num_prompts: int = Field(64, ge=1, le=MAX_COUNT, description="Conversations to keep after cleaning.")
    topics: list[Topic] = Field(
        default_factory=list,
        description="Topic seeds, used round-robin (a short instruction in the system prompt) to "
        "steer diversity; empty: no steering.",
    )
    system_prompt: str | None = Field(
        None,
        description="System message rendered before the user turn while it is sampled (with a topic "
        "seed's instruction appended); not kept in the data. None: the template's own default.",
    )
    turns: int = Field(1, ge=1, le=8, description="User turns per conversation; later ones are follow-ups.")
    temperature: FiniteFloat = Field(1.0, gt=0, le=100, description="Sampling temperature of user turns.")
    top_p: FiniteFloat = Field(0.95, gt=0, le=1)
    max_tokens: int = Field(
        96, ge=4, le=MAX_TOKENS, description="Tokens per user turn; a turn that hits it is dropped."
    )
    max_attempts_ratio: FiniteFloat = Field(
        3.0,
        ge=1,
        le=1000,
        description="Give up after num_prompts * this many attempts (an error if none was kept).",
    )
    near_duplicate_threshold: FiniteFloat = Field(
        0.7,
        gt=0,
        le=1,
        description="Estimated Jaccard similarity of word 3-grams from which a prompt is a near duplicate.",
    )
