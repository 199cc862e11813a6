"""Cleaning of generated prompts: empty, truncated, degenerate, duplicate and near-duplicate.

A small target sampling its own user turns writes many near-copies ("Hi! How are you?"),
runs into repetition loops, or stops at the token limit mid-sentence. :class:`PromptCleaner`
decides, one prompt at a time and in a fixed order, whether a prompt is kept, and names the
reason when it is not; decisions depend only on the prompts seen before, so the same
prompts in the same order always give the same kept set.

Near duplicates are found with MinHash signatures over word 3-grams of the normalised text
(lower case, punctuation removed, whitespace collapsed) and LSH banding; a candidate pair is
a near duplicate when the signatures' estimated Jaccard similarity reaches the threshold.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import defaultdict
from collections.abc import Iterable

# Drop reasons, as they appear in the prepared report.
EMPTY = "empty"
TRUNCATED = "truncated"
DEGENERATE = "degenerate"
DUPLICATE = "duplicate"
NEAR_DUPLICATE = "near_duplicate"
CONTROL_TOKEN = "control_token"

_NUM_PERM = 64
_BANDS = 16  # 16 bands x 4 rows: pairs at Jaccard 0.7 share a band with probability ~0.98
_ROWS = _NUM_PERM // _BANDS
_PRIME = (1 << 61) - 1
_rng = random.Random(20240501)  # fixed: signatures must not change between runs
_PERMS = [(_rng.randrange(1, _PRIME), _rng.randrange(0, _PRIME)) for _ in range(_NUM_PERM)]

_WORD = re.compile(r"\w+", re.UNICODE)
# The same 1..24 characters repeated 8+ times in a row ("hahaha…", "!!!!!!!!", "no no no …").
_REPEAT_RUN = re.compile(r"(.{1,24}?)\1{7,}", re.DOTALL)


def normalise(text: str) -> str:
    """Lower case words joined by single spaces: what near-identical prompts have in common."""
    return " ".join(_WORD.findall(text.lower()))


def shingles(text: str, n: int = 3) -> set[str]:
    """Word n-grams of the normalised text (the whole text when it is shorter than n words)."""
    words = normalise(text).split()
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def minhash(items: Iterable[str]) -> tuple[int, ...]:
    """MinHash signature: for each of the fixed permutations, the smallest permuted item hash."""
    hashes = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") for s in items]
    if not hashes:
        return (0,) * _NUM_PERM
    return tuple(min((a * h + b) % _PRIME for h in hashes) for a, b in _PERMS)


def estimated_jaccard(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def is_degenerate(text: str) -> bool:
    """Repetition loops: a short unit repeated 8+ times in a row, or mostly repeated word 3-grams."""
    if _REPEAT_RUN.search(text):
        return True
    words = normalise(text).split()
    if len(words) >= 12:
        grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
        if len(set(grams)) / len(grams) < 0.5:
            return True
    stripped = "".join(text.split())
    return len(stripped) >= 20 and len(set(stripped)) < 5


def turn_problem(text: str, finish_reason: str | None, control_strings: Iterable[str] = ()) -> str | None:
    """Why one generated turn is unusable on its own (None: usable). Order matters: a turn that
    hit the token limit is reported as truncated even when it also loops."""
    if not normalise(text):
        return EMPTY
    if finish_reason == "length":
        return TRUNCATED
    if any(s and s in text for s in control_strings):
        return CONTROL_TOKEN
    if is_degenerate(text):
        return DEGENERATE
    return None


class PromptCleaner:
    """Keeps prompts that are usable and neither a duplicate nor a near duplicate of a kept one."""

    def __init__(self, near_duplicate_threshold: float = 0.7, control_strings: Iterable[str] = ()):
        self.threshold = near_duplicate_threshold
        self.control_strings = tuple(control_strings)
        self._exact: set[str] = set()
        self._signatures: list[tuple[int, ...]] = []
        self._buckets: dict[tuple[int, tuple[int, ...]], list[int]] = defaultdict(list)

    def check(self, text: str, finish_reason: str | None = "stop") -> str | None:
        """None when ``text`` is kept (and remembered), else the drop reason."""
        problem = turn_problem(text, finish_reason, self.control_strings)
        if problem:
            return problem
        key = normalise(text)
        if key in self._exact:
            return DUPLICATE
        signature = minhash(shingles(text))
        bands = [(band, signature[band * _ROWS : (band + 1) * _ROWS]) for band in range(_BANDS)]
        candidates = {i for band in bands for i in self._buckets.get(band, ())}
        if any(estimated_jaccard(signature, self._signatures[i]) >= self.threshold for i in candidates):
            return NEAR_DUPLICATE
        self._exact.add(key)
        for band in bands:
            self._buckets[band].append(len(self._signatures))
        self._signatures.append(signature)
        return None
