"""Redaction of personal data and secrets in served-traffic conversations before they become training data.

A drafter learns to predict what the target says; conversations captured from a live server can carry
e-mail addresses, phone numbers, credentials and card numbers that must not end up stored in a training
set (or memorised by a model trained on it). :class:`Redactor` replaces each match with a placeholder
(``[EMAIL]``, ``[API_KEY]``, ``[CARD]``, ``[PHONE]``) and counts what it replaced, so a preparation report
can say how much was removed. A deployment-specific rule can be added as a ``str -> str`` callable, named
by import path (:func:`load_callable`), that runs after the built-in patterns.

The patterns prefer missing an odd format over damaging ordinary prose and code: versions, dates, ports,
prices and small counts are not taken for phone or card numbers.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Callable

# Order matters: keys go first so their digit runs never reach the card and phone patterns, and cards go
# before phones because a grouped card number ("4111 1111 1111 1111") is made of phone-shaped groups.
PATTERN_KINDS: tuple[str, ...] = ("email", "api_key", "card", "phone")

_PLACEHOLDER = {"email": "[EMAIL]", "api_key": "[API_KEY]", "card": "[CARD]", "phone": "[PHONE]"}

# "git@github.com:org/repo" is an SSH remote in code, not a mailbox: a ":path" right after stays.
_EMAIL = re.compile(
    r"(?<![\w.%+-])[A-Za-z0-9._%+-][A-Za-z0-9._%+'-]*@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,}\b"
    r"(?!:[\w~/])"
)

_API_KEY = re.compile(
    # The body may be JSON-escaped (a service-account file pasted whole, "\n" as two characters), and is
    # bounded so a stray BEGIN line does not scan the rest of a long text. A block without its END line
    # (a truncated paste) still loses the base64 lines that follow.
    r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----"
    r"(?:[A-Za-z0-9+/=\s:,\\-]{0,16000}?-----END[A-Z0-9 ]*PRIVATE KEY-----"
    r"|(?:(?:\s|\\[nr])*[A-Za-z0-9+/=]{16,})*)"
    r"|(?<![\w-])(?:"
    r"sk-(?:proj-)?[A-Za-z0-9_-]{20,}"
    r"|hf_[A-Za-z0-9]{30,}"
    r"|(?:ghp|gho|ghs|ghu)_[A-Za-z0-9]{20,}"
    r"|github_pat_[A-Za-z0-9_]{20,}"
    r"|(?:AKIA|ASIA)[A-Z0-9]{16}"
    r"|xox[baprs]-[A-Za-z0-9-]{10,}"
    r"|AIza[A-Za-z0-9_-]{35}"
    r")(?![\w-])"
    # The scheme word stays so the text still reads as an Authorization header.
    r"|(?P<bearer>\b[Bb]earer\s+)[A-Za-z0-9._~+/-]{20,}=*",
    re.DOTALL,
)

# Candidates only; Luhn decides. Issuer prefixes start with 2-6, which keeps out millisecond timestamps
# and most other long identifiers. Groupings are the printed ones: 4-4-4-x and Amex/Diners 4-6-4/5.
_CARD = re.compile(
    r"(?<![\w.+-])(?:[2-6]\d{12,18}|[2-6]\d{3}(?:[ -]\d{4}){2}[ -]\d{1,7}|3\d{3}[ -]\d{6}[ -]\d{4,5})"
    r"(?![\w-]|[.,]\d)"
)

# National forms need separators (one kind throughout) so that bare numbers, ids and amounts stay.
_PHONE = re.compile(
    r"(?<![\w.+-])(?:"
    r"\+[1-9]\d{0,2}(?:[ .-]?\(?\d{1,4}\)?){2,6}"
    r"|\(\d{2,4}\) ?\d{3,4}[ .-]\d{4}"
    # Not a slice of a longer run of groups, e.g. three groups out of a spaced 16-digit number.
    r"|(?<!\d[ .-])\d{2,4}(?P<sep>[ .-])\d{3,4}(?P=sep)\d{4}(?!(?P=sep)\d)"
    r")(?![\w-]|[.,]\d)"
)

# "2019 2020 2021" has the 4-4-4 shape of a national number; a run of years is far likelier in prose.
_YEAR_LIST = re.compile(r"(?:19|20)\d\d(?:[ .-](?:19|20)\d\d)+")


def luhn_valid(digits: str) -> bool:
    """True when the digit string passes the Luhn checksum that every payment card number carries."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _digits(s: str) -> str:
    return "".join(ch for ch in s if ch.isdigit())


def _card_ok(match: re.Match[str]) -> bool:
    digits = _digits(match.group())
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


def _phone_ok(match: re.Match[str]) -> bool:
    if _YEAR_LIST.fullmatch(match.group()):
        return False
    # Fewer than 9 digits is a date, a price or a short code far more often than a phone number;
    # E.164 caps real numbers at 15.
    return 9 <= len(_digits(match.group())) <= 15


def _api_key_replacement(match: re.Match[str]) -> str:
    return (match.group("bearer") or "") + _PLACEHOLDER["api_key"]


_RULES: dict[str, tuple[re.Pattern[str], Callable[[re.Match[str]], bool] | None]] = {
    "email": (_EMAIL, None),
    "api_key": (_API_KEY, None),
    "card": (_CARD, _card_ok),
    "phone": (_PHONE, _phone_ok),
}


def _callable_name(fn: Callable[..., object]) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


class Redactor:
    """Replaces personal data and secrets in text with placeholders and counts the replacements per kind."""

    def __init__(self, builtin: bool = True, custom: Callable[[str], str] | None = None):
        self.builtin = builtin
        self.custom = custom

    def text(self, text: str) -> tuple[str, Counter]:
        """The redacted text and how many replacements each kind made ("custom" counts changed texts)."""
        counts: Counter = Counter()
        if self.builtin:
            for kind in PATTERN_KINDS:
                pattern, accept = _RULES[kind]

                def replace(match: re.Match[str], kind: str = kind, accept=accept) -> str:
                    if accept is not None and not accept(match):
                        return match.group()
                    counts[kind] += 1
                    return _api_key_replacement(match) if kind == "api_key" else _PLACEHOLDER[kind]

                text = pattern.sub(replace, text)
        if self.custom is not None:
            result = self.custom(text)
            if not isinstance(result, str):
                raise TypeError(
                    f"custom redaction callable {_callable_name(self.custom)} returned "
                    f"{type(result).__name__}, expected str"
                )
            if result != text:
                counts["custom"] += 1
            text = result
        return text, counts

    def conversation(self, messages: list[dict]) -> tuple[list[dict], Counter]:
        """A redacted copy of the conversation (new list, new dicts) and the counts summed over its turns."""
        total: Counter = Counter()
        redacted = []
        for i, message in enumerate(messages):
            content = message.get("content")
            # Anything but a string (multimodal parts, None) could hide data the patterns never see.
            if not isinstance(content, str):
                raise TypeError(f"message {i} has content of type {type(content).__name__}, expected str")
            new_content, counts = self.text(content)
            total.update(counts)
            redacted.append({**message, "content": new_content})
        return redacted, total


def load_callable(import_path: str) -> Callable[[str], str]:
    """The function named by ``"package.module:function"`` (the attribute may be dotted: ``Class.method``)."""
    module_name, sep, attr_path = import_path.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"custom redaction {import_path!r} must have the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a module failing at import time is as unusable as a missing one
        raise ValueError(
            f"custom redaction {import_path!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    target: object = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ValueError(
                f"custom redaction {import_path!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from exc
    if not callable(target):
        raise ValueError(
            f"custom redaction {import_path!r}: {attr_path!r} is a {type(target).__name__}, not callable"
        )
    return target
