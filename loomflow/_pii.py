"""Shapes of personal data, shared by the PII guardrail and the audit log's redactor.

Each finder returns the ``(start, end)`` spans of one kind in a text. Checksums come from
python-stdnum, so a digit run is a card number only if it passes the Luhn check and an IBAN
candidate only if it passes ISO 13616's mod-97 check.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Mapping

from stdnum import iban as _iban
from stdnum import luhn as _luhn

__all__ = ["FINDERS", "find_cards", "find_emails", "find_ibans", "luhn_valid"]

Span = tuple[int, int]

# Letters and digits of any script: an address with one accented letter (josé@, @bücher.de)
# is as much personal data, and an ASCII-only class found none of it. The local part starts
# where a run of its characters starts (the check behind its first character): started at
# every word boundary inside a run, each start scanned on to the run's end, and a long run
# with no address after it (``a.a.a.…@``) took quadratic time. What find_emails matches; it
# searches differently (tests hold the two side by side).
EMAIL = re.compile(r"[\w.%+-](?<![\w.%+-][\w.%+-])[\w.%+-]*@[\w-]+(?:\.[\w-]+)*\.[^\W\d_]{2,}\b")
# The halves find_emails matches on each side of an ``@`` (the local part read backwards).
# Together they match what EMAIL does: the local part is the whole run before the ``@``.
_LOCAL_RUN = re.compile(r"[\w.%+-]*")
_AT_DOMAIN = re.compile(r"@[\w-]+(?:\.[\w-]+)*\.[^\W\d_]{2,}\b")
# 13 to 19 digits, optionally grouped by single spaces or dashes, not part of a longer number.
# (The first digit comes before the check behind it, and the IBAN's first letter before its
# word boundary: re then skips ahead by character class instead of trying every position.)
CARD = re.compile(r"\d(?<![\d-]\d)(?:[ -]?\d){12,18}(?![\d])")
# Country code, check digits, then groups of four, printed with or without spaces.
IBAN = re.compile(r"[A-Z](?<=\b[A-Z])[A-Z]\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b")


def luhn_valid(digits: str) -> bool:
    """Whether a string of digits passes the Luhn checksum that card numbers carry."""
    return digits.isascii() and digits.isdigit() and _luhn.is_valid(digits)


def find_emails(text: str) -> list[Span]:
    """E-mail addresses: the spans :data:`EMAIL` matches, found from each ``@`` outwards.

    Scanning the whole text with :data:`EMAIL` tries a start at every letter (2 to 3 times
    slower on prose that holds an ``@``). An address has its ``@``: re jumps from one ``@``
    to the next (a literal it searches for fast) and reads the domain after it, and only
    an ``@`` with a domain has its local part read, backwards. Neither half reads past
    another ``@``, so a text is read about twice at most.
    """
    if "@" not in text:  # the common case, without a regex scan
        return []
    found: list[Span] = []
    end = 0  # where the last address ended: matches do not overlap
    for domain in _AT_DOMAIN.finditer(text):
        at = domain.start()
        start = _local_start(text, at)
        if end <= start < at:  # a local part, not inside the last address
            end = domain.end()
            found.append((start, end))
    return found


def _local_start(text: str, at: int) -> int:
    """Where the run of local-part characters that ends just before ``text[at]`` starts
    (``at`` when there is none), looked at in growing reversed chunks: no further back than
    the run goes, plus a chunk."""
    size, stop = 64, at
    while True:
        begin = max(0, stop - size)
        match = _LOCAL_RUN.match(text[begin:stop][::-1])
        run = match.end() if match else 0
        if run < stop - begin or begin == 0:
            return stop - run
        stop, size = begin, size * 2


def find_cards(text: str) -> list[Span]:
    """Payment card numbers: 13 to 19 digits that pass the Luhn check."""
    found = []
    for match in CARD.finditer(text):
        digits = re.sub(r"[ -]", "", match.group())
        if not digits.isascii():
            # Digits of another script (fullwidth, Arabic-Indic) spell the same number
            # to a reader: checked as the ASCII digits they stand for.
            digits = "".join(str(unicodedata.decimal(c)) for c in digits)
        # All zeros passes Luhn but is a placeholder, not a card.
        if 13 <= len(digits) <= 19 and digits.strip("0") and luhn_valid(digits):
            found.append(match.span())
    return found


def find_ibans(text: str) -> list[Span]:
    """International bank account numbers that pass their checksum."""
    return [m.span() for m in IBAN.finditer(text) if _iban.is_valid(m.group())]


FINDERS: Mapping[str, Callable[[str], list[Span]]] = {
    "card": find_cards,
    "email": find_emails,
    "iban": find_ibans,
}
"""The personal-data kinds loomflow recognises, by the name redaction gives them."""
