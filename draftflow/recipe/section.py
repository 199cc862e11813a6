"""The base of every recipe section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, so a typo never goes unseen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# Upper bounds: far above any real run, low enough that a typo (an extra zero run, 1e12) is an
# error naming the field rather than an allocation or a loop that never ends.
MAX_TOKENS = 2**24  # a sequence, a context, a reply: 16M tokens
MAX_COUNT = 10**9  # samples, prompts, steps
MAX_VOCAB = 2**22  # token ids and vocabulary sizes
MAX_PARALLEL = 4096  # processes, machines, requests in flight, cores
MAX_SECONDS = 7 * 24 * 3600.0  # a timeout of a week
