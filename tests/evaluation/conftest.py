"""Fixtures for the acceptance-evaluation tests: the real SmolLM2 target and chat prompts."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_model(smollm2_dir):
    from draftflow.evaluation.offline import load_target

    return load_target(smollm2_dir)


@pytest.fixture(scope="session")
def chat_ids(smollm2_dir):
    """``chat_ids(text)``: a one-turn user prompt with SmolLM2's template and generation prompt."""
    from transformers import AutoTokenizer

    from draftflow.data.chat import ChatEncoder

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(smollm2_dir))
    return lambda text: encoder.prompt_ids([{"role": "user", "content": text}])
