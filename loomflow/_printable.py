"""Text read back from a store, made safe to show a person (a terminal or a console page).

Ids are checked when written (see ``_ids``), but that rule only refuses control characters:
a line separator (U+2028) or a bidirectional override (U+202E) is a valid id, and a crafted
row may hold anything. Shown raw, an override turns ``bob\\u202eexe.gpj`` into what reads as
``bobjpg.exe``, a line separator forges a row of a listing, and a terminal escape retitles
or clears the terminal. So every id, name and value a listing or page shows goes through
:func:`printable`, which writes each character Python calls non-printable (controls, format
characters such as the bidirectional ones, separators other than the space) as a visible
``\\u`` or ``\\x`` escape.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any, TypeVar

__all__ = [
    "escaped_controls",
    "escaped_surrogates",
    "id_literal",
    "is_unicode",
    "printable",
    "shown",
    "shown_id",
    "text_of",
    "unicode_column",
]

_T = TypeVar("_T")


def printable(value: Any) -> str:
    """``str(value)`` with every non-printable character written as its escape."""
    text = str(value)
    if text.isprintable():  # nearly always: no copy
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


_QUOTES = ("'", '"')


def id_literal(value: str) -> str:
    """An id as a Python literal, for a message or a table: ``repr``, except that an id not in
    Unicode's NFKC form is written all in ASCII escapes. Ids are compared code point for code
    point, so ``café`` typed as one character and as ``e`` plus a combining accent (as macOS
    spells file names) are two users, as are ``ﬁle`` and ``file``: shown raw, each pair would
    read as one id twice, and an erasure asked for one would leave the other."""
    if value.isascii() or unicodedata.is_normalized("NFKC", value):  # nearly always
        return repr(value)
    return ascii(value)


def shown_id(value: str | None) -> str:
    """An id (a user's, a session's) as a table or a page shows it: ``-`` for none, the id as
    it is when it reads unmistakably, else quoted as a Python literal: an id that is ``-``,
    blank, with spaces at its ends or two in a row (a table's gap; a page folds them into
    one), starting with a quote, holding characters a screen would not show, or spelled
    otherwise than Unicode's NFKC form (see :func:`id_literal`)."""
    if value is None:
        return "-"
    if (
        value in ("", "-")
        or value != value.strip()
        or value.startswith(_QUOTES)
        or "  " in value
        or not value.isprintable()
    ):
        return id_literal(value)
    if not value.isascii() and not unicodedata.is_normalized("NFKC", value):
        return ascii(value)
    return value


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a value from a hand-edited row, named in
    an error. ``repr`` escapes control characters, so a crafted value cannot drive a
    terminal; the cut keeps a huge one from filling the message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def text_of(value: object) -> str | None:
    """A text column of a row as it is (``None`` too), or :func:`shown` of whatever else a
    hand-edited row holds there: for listing a damaged row without trusting it."""
    return value if value is None or isinstance(value, str) else shown(value)


def is_unicode(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form: False for text read back from a SQLite row whose
    bytes are not UTF-8, which arrives holding lone surrogates (``storage/_sqlite.read_text``)."""
    if text.isascii():  # nearly always: no copy
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def escaped_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its ``\\udcxx`` escape: a JSON document or
    line naming a damaged row says what the row holds (inside a JSON string the escape reads
    back as that very surrogate), where UTF-8 output would fail on it."""
    return text if is_unicode(text) else text.encode("utf-8", "backslashreplace").decode()


# What JSON may carry raw but a terminal acts on: DEL and the C1 controls (U+009B starts an
# escape sequence on terminals that take 8-bit ones), the marks that reorder or hide text
# around them (bidirectional overrides and isolates, the line and paragraph separators), and
# the characters a screen does not show at all (zero-width spaces and joiners, the word
# joiner, the soft hyphen, a BOM), by which "a\u200bna" reads as the id "ana".
_TERMINAL_CONTROLS = re.compile(
    "[\x7f-\x9f\xad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]"
)


def escaped_controls(json_text: str) -> str:
    """JSON text with each character a terminal would act on written as its ``\\uXXXX``
    escape: the same document to a JSON reader, inert on a screen. Such characters only occur
    inside strings (JSON's own syntax is plain ASCII), where the escape stands for them."""
    if json_text.isascii() and "\x7f" not in json_text:  # nearly always: no copy
        return json_text
    return _TERMINAL_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)


def unicode_column(column: str, value: _T) -> _T:
    """``value`` as it is, unless it is text that is not UTF-8: then a ValueError naming the
    column, for the store reading the row to report it as damaged instead of handing the
    text on (an output, a prompt, an id) to be shown, sent to a model or written back, where
    UTF-8 cannot spell it."""
    if isinstance(value, str) and not is_unicode(value):
        raise ValueError(f"{column} holds text that is not UTF-8 ({shown(value)})")
    return value
