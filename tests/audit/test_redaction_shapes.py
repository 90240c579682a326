"""The shapes redaction and the PII finders use find exactly what their plain forms find.

The shipped regular expressions are written literal-first so that ``re`` can skip ahead (see
``loomflow.redaction.SECRET_PATTERNS``); the plain forms below are how one would first write
them. On any text, both must match the same spans.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomflow import _pii, redaction
from loomflow.redaction import SECRET_PATTERNS, Redactor

PLAIN_SECRETS = {
    "private_key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
    "api_key": r"\bsk-[A-Za-z0-9_\-]{16,}",
    "aws_access_key": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "google_api_key": r"\bAIza[0-9A-Za-z_\-]{35}",
    "github_token": r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})",
    "slack_token": r"\bxox[abposr]-[A-Za-z0-9\-]{10,}",
    "stripe_key": r"\b[rs]k_live_[A-Za-z0-9]{16,}",
    "jwt": r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",
    "bearer_token": r"(?i)\bbearer\s+[A-Za-z0-9\-._~+/]{8,}=*",
}
PLAIN_PII = {
    "card": r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d])",
    "iban": r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b",
}

# Pieces that start, end or break every shape, so that generated texts hit the edges.
PIECES = [
    "sk-", "AKIA", "ASIA", "AIza", "ghp_", "gho_", "github_pat_", "xoxb-", "xoxz-", "eyJ",
    "Bearer ", "bEaReR\t", "bearer", "sk_live_", "rk_live_", "-----BEGIN RSA PRIVATE KEY-----",
    "-----END RSA PRIVATE KEY-----", "GB82", "WEST", "1234", "4111 1111 1111 1111",
    "4111-1111-1111-1111", "@", "ana@example.com", ".", "=", "_", "-", " ", "\n", "x", "Z",
    "0", "9", "é", "\u017f", "\u212a",  # long s, Kelvin sign (they fold to s, k)
    "aaaaaaaaaaaaaaaa", "ABCDEFGHIJKLMNOP", "0123456789",
]  # fmt: skip
texts = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=30).map("".join)


def _spans(pattern: re.Pattern[str], text: str) -> list[tuple[int, int]]:
    return [m.span() for m in pattern.finditer(text)]


SHIPPED = dict(SECRET_PATTERNS)
PAIRS = [(re.compile(PLAIN_SECRETS[kind]), re.compile(SHIPPED[kind])) for kind in PLAIN_SECRETS] + [
    (re.compile(PLAIN_PII["card"]), _pii.CARD),
    (re.compile(PLAIN_PII["iban"]), _pii.IBAN),
]


def test_every_shipped_secret_shape_has_its_plain_form() -> None:
    assert set(SHIPPED) == set(PLAIN_SECRETS)


@settings(max_examples=600, deadline=None)
@given(texts)
def test_the_shapes_match_what_their_plain_forms_match(text: str) -> None:
    for plain, shipped in PAIRS:
        assert _spans(shipped, text) == _spans(plain, text), (plain.pattern, text)


# Pieces of addresses, their edges and their near misses: runs of local-part characters,
# several ``@``s, labels that end in digits or ``_``, letters, digits and marks of other
# scripts (accented, Greek, Arabic-Indic and superscript digits, a Roman numeral, a
# combining accent, CJK), and characters that end an address.
EMAIL_PIECES = [
    "@", "@@", ".", "..", "-", "_", "%", "+", "a", "Z", "1", "a.", ".a", "a.a.a.", "x-y",
    "ana", "ex.com", "mail.example.org", ".co", ".c", "cd", "b.c1", "_x", "é", "ß", "Ω",
    "\u0661", "\u00b2", "\u216b", "e\u0301", "\u4e2d\u6587", "josé", "bücher.de", " ", "\n",
    "«", "»", "'", "<", ">", ",", "!", "\u200b",
]  # fmt: skip
email_texts = st.lists(
    st.sampled_from(EMAIL_PIECES) | st.sampled_from(PIECES) | st.text(max_size=3), max_size=40
).map("".join)


@settings(max_examples=600, deadline=None)
@given(email_texts)
def test_emails_are_found_where_the_pattern_finds_them(text: str) -> None:
    # find_emails searches from each "@" outwards; EMAIL says what an address is.
    assert _pii.find_emails(text) == _spans(_pii.EMAIL, text), text


def test_long_local_parts_are_found_whole() -> None:
    # The local part is read backwards in growing chunks: runs around the chunk sizes.
    for size in (1, 63, 64, 65, 127, 128, 192, 193, 1000):
        for before in ("", " ", "a", "@"):
            text = f"{before}{'a.' * size}@example.com."
            assert _pii.find_emails(text) == _spans(_pii.EMAIL, text), (size, before)


@settings(max_examples=300, deadline=None)
@given(texts)
def test_redacted_text_is_what_the_plain_shapes_give(text: str) -> None:
    expected = text
    for kind, rx in PLAIN_SECRETS.items():
        expected = re.sub(rx, f"[REDACTED:{kind}]", expected)
    assert Redactor(pii=False).text(text) == expected


def test_every_kind_of_github_token_is_redacted() -> None:
    r = Redactor(pii=False)
    for token in ("ghp_" + "a1" * 18, "gho_" + "B" * 36, "github_pat_" + "x1_" * 14):
        assert r.text(f"token {token} here") == "token [REDACTED:github_token] here"


def test_a_shape_is_found_mid_text_and_not_inside_a_word() -> None:
    r = Redactor(pii=False)
    key = "sk-" + "a1" * 10
    assert r.text(f"use {key} now") == "use [REDACTED:api_key] now"
    assert r.text(f"task{key}") == f"task{key}"  # no word boundary before it
    assert r.text("BEARER abcdefgh12") == "[REDACTED:bearer_token]"
    assert r.text("unbearer abcdefgh12") == "unbearer abcdefgh12"


def _min_width(pattern: str) -> int:
    # re's own parser (private, but the one authority on what a pattern can match).
    return int(re._parser.parse(pattern).getwidth()[0])  # type: ignore[attr-defined]


def test_the_length_shortcut_is_no_longer_than_any_shape() -> None:
    widths = [_min_width(rx) for _, rx in SECRET_PATTERNS]
    assert min(widths) == redaction._SHORTEST_SHAPE
    pii = [_min_width(p.pattern) for p in (_pii.EMAIL, _pii.CARD, _pii.IBAN)]
    assert min(pii) == redaction._SHORTEST_BUILTIN_PII


def _unhurried(redactor: Redactor) -> Redactor:
    """The same redactor with the length shortcut off: every rule runs on every text."""
    redactor._shortest = redactor._shortest_secret = 0
    return redactor


@settings(max_examples=400, deadline=None)
@given(texts, st.booleans())
def test_the_length_shortcut_changes_no_result(text: str, pii: bool) -> None:
    for make in (
        lambda: Redactor(),
        lambda: Redactor(secrets=["abcd", "longer-secret"]),
        lambda: Redactor(pii_patterns={"code": "Q"}),
        lambda: Redactor(patterns=False, pii=False),
    ):
        quick, full = make(), _unhurried(make())
        for cut in range(0, len(text) + 1, 3):  # short prefixes are the ones it skips
            assert quick.text(text[:cut], pii=pii) == full.text(text[:cut], pii=pii)


def test_learned_secrets_lower_the_shortcut() -> None:
    r = Redactor()
    assert r.text("wxyz") == "wxyz"
    r.learn({"password": "wxyz"})
    assert r.text("wxyz") == "[REDACTED]"


def test_sensitive_keys_are_found_in_camel_and_kebab_case() -> None:
    # "apiKey" was hidden (apikey is listed) but "accessToken", "clientSecret" and
    # "privateKey" were not: camelCase lost the "_" the list spells them with.
    r = Redactor()
    value = {
        "accessToken": "t0k3n-value",
        "clientSecret": "s3cr3t-value",
        "privateKey": "k3y-value",
        "Refresh-Token": "r3fresh-value",
        "SET_COOKIE": "c00kie-value",
        "username": "ana",
    }
    hidden = {k: "[REDACTED]" for k in value if k != "username"}
    assert r.value(value) == {**hidden, "username": "ana"}
    assert r.arguments(value, ()) == {**hidden, "username": "ana"}


def test_stripe_keys_are_secret_shapes_as_the_pii_guardrail_finds_them() -> None:
    # PIIGuardrail found sk_live_/rk_live_ keys, but the redactor did not: such a key in a
    # tool argument was neither sealed in the journal nor hidden from the audit log.
    r = Redactor(pii=False)
    for key in ("sk_live_" + "4eC39HqLyjWDarjt", "rk_live_" + "Z" * 24):
        assert r.text(f"key {key} here") == "key [REDACTED:stripe_key] here"
        assert r.contains_secret(key)
    assert r.text("task_live_" + "a" * 20) == "task_live_" + "a" * 20  # not at a word start


# -- secret values: learned ones are looked for on their own until a recompile -------------

values = st.text(alphabet="ab-", min_size=4, max_size=7)
# learn a value, redact a text, or fold what was learned into the compiled pattern
steps = st.lists(
    st.tuples(st.sampled_from(["learn", "text", "compile"]), values, texts | values),
    max_size=25,
)


@settings(max_examples=400, deadline=None)
@given(st.lists(values, max_size=3), st.integers(1, 6), steps)
def test_secret_values_are_found_as_one_longest_first_alternation(
    configured: list[str], max_learned: int, steps: list[tuple[str, str, str]]
) -> None:
    # As a flat "v1|v2|…" of the live values, longest first, found them: learned values
    # not yet compiled, and forgotten values the pattern still holds, change nothing.
    r = Redactor(secrets=configured, patterns=False, pii=False, max_learned=max_learned)
    for action, value, text in steps:
        if action == "learn":
            r.learn(value)
        elif action == "compile":
            r._compile()
        for sample in (text, text + value + text, value + value[1:]):
            live = sorted(set(configured) | r._learned.keys(), key=len, reverse=True)
            expected = (
                re.sub("|".join(map(re.escape, live)), "[REDACTED]", sample) if live else sample
            )
            assert r.text(sample) == expected, (live, sample)


def test_learning_a_value_does_not_recompile_every_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each value learned recompiled all of them (about 0.3 ms a value): learning 1,000 values,
    # each followed by a redaction, took minutes. Counted, not timed: the values compiled over
    # the 1,000 learns add up to a few times 1,000 (half a million when each learn recompiled).
    compiled: list[int] = []
    compile_all = Redactor._compile

    def counted(self: Redactor) -> None:
        compiled.append(len(self._configured | self._learned.keys()))
        compile_all(self)

    monkeypatch.setattr(Redactor, "_compile", counted)
    r = Redactor(patterns=False, pii=False)
    for n in range(1_000):
        r.learn(f"learned-value-{n:04}")
        assert r.text(f"call with learned-value-{n:04} and learned-value-0000") == (
            "call with [REDACTED] and [REDACTED]"
        )
    assert sum(compiled) < 5 * 1_000
