"""Redaction runs on text from outside (tool results, model answers, log records): a crafted
text must not make it take quadratic time.

Before: 100 KB of ``a.a.a.…@`` took 39 s in the e-mail finder, and 140 KB of private key
begin markers 13 s in the private key shape, for every audit entry, span or log record that
held them (a tool reading a hostile web page held up its run for minutes).
"""

from __future__ import annotations

import time

import pytest

from loomflow import _pii
from loomflow.redaction import Redactor

BEGIN = "-----BEGIN PRIVATE KEY-----\n"
END = "-----END PRIVATE KEY-----"


@pytest.mark.parametrize(
    "text",
    [
        "a." * 100_000 + "@",
        "a.b" * 60_000 + "@c",
        "x" + "-a" * 100_000 + "@example",
        BEGIN * 10_000,
        END + "\n" + BEGIN * 10_000,
        BEGIN * 10_000 + "PRIVATE KEY-----",
        "a@" * 100_000,
        "x@" + "a." * 100_000,
        "x@" + "ab1." * 50_000,
        ("a." * 500 + "@") * 200,
        "a@b.c " * 30_000,
    ],
    ids=[
        "dots-then-at",
        "runs-then-at",
        "dashes-then-at",
        "begins",
        "end-then-begins",
        "tail",
        "many-ats",
        "long-domain",
        "labels-with-digits",
        "long-local-parts",
        "near-misses",
    ],
)
def test_hostile_text_is_redacted_in_linear_time(text: str) -> None:
    started = time.perf_counter()
    Redactor().text(text)
    assert time.perf_counter() - started < 3  # was 20 s to minutes


def test_the_shapes_are_still_found() -> None:
    r = Redactor()
    key = f"{BEGIN}MIIEvQIBADANBg\n{END}"
    assert r.text(f"k: {key} and ana@example.com") == (
        "k: [REDACTED:private_key] and [REDACTED:email]"
    )
    # From the first begin marker to the first end marker after it, as before.
    assert r.text(f"{BEGIN}x{BEGIN}y{END} z {END}") == f"[REDACTED:private_key] z {END}"
    assert r.text(f"{END} {BEGIN}cut off") == f"{END} {BEGIN}cut off"
    assert _pii.find_emails("mail bo.b+x@mail.example.org, a@b.c!") == [(5, 28)]
    # An address right after characters that cannot start one is still found; a letter of
    # any script belongs to the address.
    assert r.text("«ana@example.com»") == "«[REDACTED:email]»"
    assert r.text("éana@example.com") == "[REDACTED:email]"  # was left whole
