"""The base of every recipe section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, so a typo never goes unseen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
