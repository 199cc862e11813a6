"""Redaction of served-traffic conversations: each built-in kind, counts, false positives, custom rules."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest

from draftflow.data.redaction import PATTERN_KINDS, Redactor, load_callable, luhn_valid

# Token-shaped fakes are assembled at run time so that secret scanners do not flag this file.
OPENAI_KEY = "sk-" + "T3stKeyAbCdEfGhIjKlMnOp"
OPENAI_PROJECT_KEY = "sk-proj-" + "Zx9_Yw8-Vu7Ts6Rq5Po4Nm3Lk2"
HF_TOKEN = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ012345"
GITHUB_TOKEN = "ghp_" + "16C7e42F292c6912E7710c838347Ae178B4a"
GITHUB_PAT = "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz"
AWS_KEY_ID = "AKIA" + "IOSFODNN7EXAMPLE"
SLACK_TOKEN = "xoxb-" + "123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"
GOOGLE_KEY = "AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"
BEARER_TOKEN = "eyJhbGciOiJIUzI1NiJ9" + ".eyJzdWIiOiIxMjM0NTYifQ.c2lnbmF0dXJlX2hlcmU"
PEM_BODY = "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun"
PEM = "-----BEGIN RSA PRIVATE KEY-----\n" + PEM_BODY + "\nVWdOzhv8ZdX3l4H2\n-----END RSA PRIVATE KEY-----"

VISA = "4111 1111 1111 1111"
MASTERCARD = "5555-5555-5555-4444"
AMEX = "378282246310005"
DISCOVER = "6011111111111117"


def bracket_names(text: str) -> str:
    """A deployment rule: internal host names become a placeholder."""
    return text.replace("db-prod-7.internal", "[HOST]")


def test_pattern_kinds_are_the_four_builtins_with_keys_before_digits():
    assert set(PATTERN_KINDS) == {"email", "phone", "api_key", "card"}
    assert PATTERN_KINDS.index("api_key") < PATTERN_KINDS.index("card") < PATTERN_KINDS.index("phone")


@pytest.mark.parametrize(
    "address",
    ["john.doe@example.com", "a.b+newsletter@mail.example.co.uk", "Jane_O'Neil@sub-domain.org", "x1@ex.io"],
)
def test_emails_inside_sentences_are_replaced(address):
    text, counts = Redactor().text(f"Please write to <{address}>, I check it daily.")
    assert text == "Please write to <[EMAIL]>, I check it daily."
    assert counts == Counter(email=1)


@pytest.mark.parametrize(
    "number",
    [
        "(555) 123-4567",
        "555-123-4567",
        "555.123.4567",
        "+44 20 7946 0958",
        "+1 (555) 123-4567",
        "020 7946 0958",
    ],
)
def test_phone_numbers_inside_sentences_are_replaced(number):
    text, counts = Redactor().text(f"You can reach me at {number} after lunch.")
    assert text == "You can reach me at [PHONE] after lunch."
    assert counts == Counter(phone=1)


@pytest.mark.parametrize(
    "key",
    [OPENAI_KEY, OPENAI_PROJECT_KEY, HF_TOKEN, GITHUB_TOKEN, GITHUB_PAT, AWS_KEY_ID, SLACK_TOKEN, GOOGLE_KEY],
)
def test_api_keys_inside_sentences_are_replaced(key):
    text, counts = Redactor().text(f'My key is "{key}" but it fails with 401.')
    assert text == 'My key is "[API_KEY]" but it fails with 401.'
    assert counts == Counter(api_key=1)


def test_bearer_keeps_the_scheme_word_and_loses_the_token():
    text, counts = Redactor().text(f"curl -H 'Authorization: Bearer {BEARER_TOKEN}' https://api.example.com")
    assert text == "curl -H 'Authorization: Bearer [API_KEY]' https://api.example.com"
    assert counts == Counter(api_key=1)


def test_pem_private_key_block_is_replaced_whole():
    text, counts = Redactor().text(f"Here is my key:\n{PEM}\nWhy does ssh reject it?")
    assert text == "Here is my key:\n[API_KEY]\nWhy does ssh reject it?"
    assert counts == Counter(api_key=1)


def test_truncated_pem_block_still_loses_its_base64_lines():
    text, _ = Redactor().text(
        f"-----BEGIN OPENSSH PRIVATE KEY-----\n{PEM_BODY}\n{PEM_BODY[::-1]}\n\nIs this right?"
    )
    assert PEM_BODY not in text and PEM_BODY[::-1] not in text
    assert text == "[API_KEY]\n\nIs this right?"


def test_json_escaped_private_key_in_a_pasted_service_account_file_is_replaced():
    pem = "-----BEGIN PRIVATE KEY-----\n" + PEM_BODY + "\n-----END PRIVATE KEY-----\n"
    pasted = json.dumps({"type": "service_account", "private_key": pem, "project_id": "demo"})
    text, counts = Redactor().text(f"Why does this fail?\n{pasted}")
    assert PEM_BODY not in text and "PRIVATE KEY" not in text
    assert json.loads(text.split("\n", 1)[1]) == {
        "type": "service_account",
        "private_key": "[API_KEY]\n",
        "project_id": "demo",
    }
    assert counts == Counter(api_key=1)


@pytest.mark.parametrize("card", [VISA, MASTERCARD, AMEX, DISCOVER, "3782 822463 10005"])
def test_luhn_valid_card_numbers_inside_sentences_are_replaced(card):
    text, counts = Redactor().text(f"Charge {card} for the order, thanks.")
    assert text == "Charge [CARD] for the order, thanks."
    assert counts == Counter(card=1)


@pytest.mark.parametrize("number", ["4111111111111112", "5555 5555 5555 4445", "6011-1111-1111-1118"])
def test_luhn_failing_card_shaped_numbers_are_kept(number):
    assert not luhn_valid(number.replace(" ", "").replace("-", ""))
    text = f"Order reference {number} shipped."
    assert Redactor().text(text) == (text, Counter())


def test_luhn_checksum():
    assert luhn_valid("4111111111111111") and luhn_valid("79927398713")
    assert not luhn_valid("4111111111111112") and not luhn_valid("79927398710")


@pytest.mark.parametrize(
    "text",
    [
        "Upgrade to version 1.2.3 or Python 3.10.2 first.",
        "The release is planned for 2024-05-01 at 09:30.",
        "The server listens on port 8000 (or 8080).",
        "x = 12345\ny = x * 2 + 1_000_000",
        "Can you call at 5pm tomorrow?",
        "It costs $1,299.99, down from $1,499.00 in 1999.",
        "Ping 192.168.1.10 and 10.0.0.1:8000.",
        "Revenue grew in 2019 2020 2021 and fell in 2022.",
        "ts = 1714567890123  # milliseconds",
        "id 123e4567-e89b-12d3-a456-426614174000, commit 3f786850e387550fdab836ed7e6dc881de23001b",
        "git clone git@github.com:org/repo.git && pip install 'pkg>=2.0.1'",
        "I have 3 cats, 12 dogs and 1024 fish; the bearer of bad news is here.",
        "ISBN 978-3-16-148410-0, sk-short, hf_tiny, call 555-1234.",
        "The diff is +120 -35, the offset +1.5 2.5 and the score +10 20 30.",
    ],
)
def test_ordinary_prose_and_code_are_untouched(text):
    assert Redactor().text(text) == (text, Counter())


def test_counts_per_kind_over_a_mixed_text():
    text = (
        f"Mail a@example.com or b@example.org, call 555-123-4567, "
        f"pay with {VISA}, keys {OPENAI_KEY} {HF_TOKEN} {AWS_KEY_ID}."
    )
    redacted, counts = Redactor().text(text)
    assert counts == Counter(email=2, phone=1, card=1, api_key=3)
    assert redacted == (
        "Mail [EMAIL] or [EMAIL], call [PHONE], pay with [CARD], keys [API_KEY] [API_KEY] [API_KEY]."
    )


def test_without_builtins_or_custom_the_text_is_unchanged():
    text = f"a@example.com {VISA} {OPENAI_KEY}"
    assert Redactor(builtin=False, custom=None).text(text) == (text, Counter())


def test_custom_runs_after_builtins_and_counts_only_when_it_changes_the_text():
    seen: list[str] = []

    def rule(text: str) -> str:
        seen.append(text)
        return bracket_names(text)

    redactor = Redactor(custom=rule)
    text, counts = redactor.text("Host db-prod-7.internal, owner ops@example.com")
    assert seen == ["Host db-prod-7.internal, owner [EMAIL]"]
    assert text == "Host [HOST], owner [EMAIL]"
    assert counts == Counter(email=1, custom=1)
    assert redactor.text("nothing to see") == ("nothing to see", Counter())


def test_custom_exceptions_propagate():
    def broken(text: str) -> str:
        raise RuntimeError("rule exploded")

    with pytest.raises(RuntimeError, match="rule exploded"):
        Redactor(custom=broken).text("hello")


def test_custom_returning_a_non_string_is_a_type_error_naming_it():
    def returns_none(text: str):
        return None

    with pytest.raises(TypeError, match="returns_none.*NoneType"):
        Redactor(custom=returns_none).text("hello")


def test_conversation_keeps_roles_and_extra_keys_and_does_not_mutate_input():
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "My email is jo@example.com and card " + VISA, "name": "jo"},
        {"role": "assistant", "content": "Thanks, I will not store 555-123-4567."},
    ]
    before = copy.deepcopy(messages)
    result, counts = Redactor().conversation(messages)
    assert messages == before
    assert result is not messages and all(new is not old for new, old in zip(result, messages))
    assert [m["role"] for m in result] == ["system", "user", "assistant"]
    assert result[1] == {"role": "user", "content": "My email is [EMAIL] and card [CARD]", "name": "jo"}
    assert result[2]["content"] == "Thanks, I will not store [PHONE]."
    assert counts == Counter(email=1, card=1, phone=1)


def test_conversation_rejects_non_string_content():
    with pytest.raises(TypeError, match="message 1"):
        Redactor().conversation([{"role": "user", "content": "hi"}, {"role": "user", "content": None}])


def test_planted_secrets_appear_nowhere_after_redaction():
    planted = {
        "email": "planted.person@example.net",
        "phone": "+1 (415) 555-0199",
        "card": MASTERCARD,
        "openai": OPENAI_PROJECT_KEY,
        "hf": HF_TOKEN,
        "github": GITHUB_TOKEN,
        "aws": AWS_KEY_ID,
        "slack": SLACK_TOKEN,
        "google": GOOGLE_KEY,
        "bearer": BEARER_TOKEN,
        "pem": PEM_BODY,
    }
    messages = [
        {"role": "system", "content": f"Internal contact: {planted['email']}"},
        {"role": "user", "content": f"Call {planted['phone']}; my card is {planted['card']}."},
        {"role": "assistant", "content": "I cannot use payment details."},
        {
            "role": "user",
            "content": (
                f"export OPENAI_API_KEY={planted['openai']}\nHF_TOKEN={planted['hf']}\n"
                f"GH={planted['github']} AWS={planted['aws']} SLACK={planted['slack']}\n"
                f"GOOGLE={planted['google']}\nAuthorization: Bearer {planted['bearer']}\n{PEM}"
            ),
        },
    ]
    result, counts = Redactor().conversation(messages)
    dumped = json.dumps(result)
    assert [name for name, secret in planted.items() if secret in dumped] == []
    assert counts == Counter(email=1, phone=1, card=1, api_key=8)


def test_load_callable_imports_a_function_from_this_test_module_and_the_stdlib():
    rule = load_callable(f"{__name__}:bracket_names")
    assert rule is bracket_names
    assert Redactor(builtin=False, custom=rule).text("on db-prod-7.internal") == (
        "on [HOST]",
        Counter(custom=1),
    )
    capwords = load_callable("string:capwords")
    assert capwords("hello world") == "Hello World"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("string.capwords", "must have the form 'package.module:function'"),
        (":capwords", "must have the form"),
        ("string:", "must have the form"),
        ("draftflow.no_such_module:f", "cannot import module 'draftflow.no_such_module'"),
        ("string:no_such_function", "module 'string' has no attribute 'no_such_function'"),
        ("string:ascii_letters", "'ascii_letters' is a str, not callable"),
    ],
)
def test_load_callable_errors_name_the_problem(path, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_callable(path)
