"""The base of every recipe section, and of every drafter kind's section."""

from __future__ import annotations

import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, so a typo never goes unseen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class DrafterSection(Section):
    """The recipe's `drafter`: one section per drafter kind, chosen by `kind`."""

    # Read outside the kind (recipe checks, the trainer): every kind's section declares them.
    SHARED_FIELDS: ClassVar[tuple[str, ...]] = ("context_layer_ids", "draft_vocab_size")

    kind: str

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # A kind section found by the registry is checked where it is written, not at first use.
        annotation = cls.model_fields["kind"].annotation
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) is not typing.Literal or len(args) != 1:
            raise TypeError(f'{cls.__qualname__}: a drafter section declares `kind: Literal["name"]`')
        missing = [name for name in cls.SHARED_FIELDS if name not in cls.model_fields]
        if missing:
            raise TypeError(f"{cls.__qualname__}: a drafter section declares {', '.join(missing)}")

    @classmethod
    def kind_name(cls) -> str:
        """The `kind` a recipe names this section by (= the checkpoint's speculators_model_type)."""
        return typing.get_args(cls.model_fields["kind"].annotation)[0]


# Upper bounds: far above any real run, low enough that a typo (an extra zero run, 1e12) is an
# error naming the field rather than an allocation or a loop that never ends.
MAX_TOKENS = 2**24  # a sequence, a context, a reply: 16M tokens
MAX_COUNT = 10**9  # samples, prompts, steps
MAX_VOCAB = 2**22  # token ids and vocabulary sizes
MAX_PARALLEL = 4096  # processes, machines, requests in flight, cores
MAX_SECONDS = 7 * 24 * 3600.0  # a timeout of a week
