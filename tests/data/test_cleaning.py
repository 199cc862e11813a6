"""Prompt cleaning detectors: exact and near duplicates, degenerate loops, empty and truncated turns."""

from __future__ import annotations

from draftflow.data.cleaning import (
    CONTROL_TOKEN,
    DEGENERATE,
    DUPLICATE,
    EMPTY,
    NEAR_DUPLICATE,
    TRUNCATED,
    PromptCleaner,
    estimated_jaccard,
    is_degenerate,
    minhash,
    normalise,
    shingles,
)

LONG = (
    "Can you help me write a Python function that reads a CSV file of sales records and returns "
    "the total revenue per region, sorted from the highest to the lowest?"
)


def test_exact_duplicates_differ_only_in_case_punctuation_and_spacing():
    cleaner = PromptCleaner()
    assert cleaner.check("What is the capital of France?") is None
    assert cleaner.check("  what is the CAPITAL of france ") == DUPLICATE
    assert cleaner.check("What is the capital of Spain?") is None


def test_near_duplicate_one_word_changed_in_a_long_prompt():
    cleaner = PromptCleaner(0.7)
    assert cleaner.check(LONG) is None
    assert cleaner.check(LONG.replace("highest", "largest")) == NEAR_DUPLICATE
    assert cleaner.check(LONG + " Use pandas.") == NEAR_DUPLICATE
    # Same opening, another request: shares under 70% of its 3-grams, so it stays.
    assert cleaner.check(LONG.replace("sorted from the highest to the lowest", "as a bar chart")) is None


def test_different_prompts_on_the_same_topic_are_kept():
    cleaner = PromptCleaner(0.7)
    prompts = [
        LONG,
        "Write a Python script that downloads a web page and counts how often each word appears in it.",
        "How do I reverse a linked list in C, and what is the time complexity of doing it in place?",
        "Explain the difference between a list and a tuple in Python with a short example of each.",
    ]
    assert [cleaner.check(p) for p in prompts] == [None] * 4


def test_minhash_estimates_jaccard():
    a, b = shingles(LONG), shingles(LONG.replace("highest", "largest"))
    exact = len(a & b) / len(a | b)
    assert abs(estimated_jaccard(minhash(a), minhash(b)) - exact) < 0.2
    assert minhash(a) == minhash(set(a))  # deterministic
    unrelated = shingles("Tell me a joke about penguins who learn to ski in the Alps during winter.")
    assert estimated_jaccard(minhash(a), minhash(unrelated)) < 0.2


def test_degenerate_repetition_loops():
    assert is_degenerate("ha" * 20)
    assert is_degenerate("Please help me. " + "I need help " * 10)
    assert is_degenerate("!!!!!!!!!!!!!!!!!!!!!!!")
    assert is_degenerate("the cat the cat the cat the cat the cat the cat the cat the cat the cat")
    assert not is_degenerate(LONG)
    assert not is_degenerate("What is 2 + 2? And what is 3 + 3?")


def test_empty_truncated_degenerate_and_control_tokens_are_dropped_with_their_reason():
    cleaner = PromptCleaner(control_strings=["<|im_end|>"])
    assert cleaner.check("   ") == EMPTY
    assert cleaner.check("?!") == EMPTY
    assert cleaner.check(LONG, finish_reason="length") == TRUNCATED
    assert cleaner.check("no " * 30) == DEGENERATE
    assert cleaner.check("Hello<|im_end|>assistant") == CONTROL_TOKEN
    # Dropped prompts are not remembered: the good version is still new.
    assert cleaner.check(LONG) is None


def test_normalise():
    assert normalise("  Hello,   WORLD!\n") == "hello world"
