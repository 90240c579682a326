"""What every command group shares: argument types and the plain-text table."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._ids import user_label as who
from .._printable import escaped_controls, escaped_surrogates, printable, shown_id
from .._timefmt import iso_time, parse_age, parse_when, table_iso, table_time
from ..errors import InvalidArgumentError

__all__ = [
    "DAMAGED_ROWS",
    "damaged_rows",
    "damaged_trail",
    "duration",
    "exception_line",
    "fixed_port",
    "id_cell",
    "iso_time",
    "json_text",
    "login",
    "one_line",
    "port",
    "positive_int",
    "some_path",
    "printable",
    "prune_age",
    "table",
    "table_iso",
    "table_time",
    "user_cell",
    "when",
    "who",
]


def damaged_trail(user: str | None, problems: Sequence[dict[str, Any]]) -> str:
    """The warning line for an export of a trail that fails verification (``problems`` as in
    ``verify --json``): exported as stored, but it must not pass for the record unremarked."""
    first = problems[0]
    option = "--anonymous" if user is None else f"--user {shlex.quote(user)}"
    seq = "-" if first["seq"] is None else first["seq"]
    message = (
        f"the audit trail of {who(user)} fails verification: {len(problems)} problem(s), "
        f"the first {first['kind']}, entry {seq}: {first['detail']}; "
        f"see `loomflow audit verify {option}`"
    )
    return f"loomflow: warning: {printable(message)}"


DAMAGED_ROWS = 3
"""The exit status of an ``audit query``, ``audit export`` or ``users export`` that went on
past stored audit rows it could not read: what it wrote is incomplete (each row is marked in
it and named on stderr), unlike 0, and yet written, unlike 1."""


def damaged_rows(rows: Sequence[dict[str, Any]], what: str) -> list[str]:
    """The stderr lines for damaged audit rows in an output: one per row (``rows`` as marked
    in the output: ``"unreadable"`` says why, with ``user_id``, ``seq`` and, for a row that
    reads as no entry, ``row``; ``position`` for a page's damaged rows), then what it means
    for ``what`` (the export, the page)."""
    lines = []
    for row in rows:
        where = row.get("row", row.get("position"))
        seq = "?" if row.get("seq") is None else row["seq"]
        place = f"row {where} of " if where is not None else ""
        why = row.get("unreadable", row.get("detail"))
        message = (
            f"damaged audit row: {place}the trail of {who(row.get('user_id'))}, entry {seq}: {why}"
        )
        lines.append(f"loomflow: error: {printable(message)}")
    lines.append(
        f"loomflow: error: {len(rows)} audit row(s) could not be read (each named above): "
        f"{what} is incomplete; see `loomflow audit verify`"
    )
    return lines


def duration(text: str) -> dt.timedelta:
    """``30m``, ``12h``, ``7d``... as an argparse type (every ``--older-than``)."""
    return _age(text, "")


def prune_age(text: str) -> dt.timedelta:
    """:func:`duration` for ``journal prune --older-than``, whose zero points to ``--all``."""
    return _age(text, "; --all prunes every finished run, whatever its age")


def _age(text: str, zero_hint: str) -> dt.timedelta:
    try:
        age = parse_age(text)
    except InvalidArgumentError as exc:
        # ArgumentTypeError, not the ValueError it is: argparse would hide the message.
        raise argparse.ArgumentTypeError(str(exc)) from None
    if age is None and text.strip().isdecimal() and int(text) == 0:
        age = dt.timedelta(0)  # a bare 0 is a zero age, not a typo of some unit
    if age is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 12h or 7d")
    if age <= dt.timedelta(0):
        # "Older than nothing" is everything: a prune or retention of every finished run or
        # payload must be asked for by name (--all), not reached by a zero.
        raise argparse.ArgumentTypeError(
            f"{text!r} is no age: give one such as 30m, 12h or 7d{zero_hint}"
        )
    return age


def when(text: str) -> dt.datetime:
    """``24h`` / ``7d`` (that long ago), or an ISO 8601 date or time (UTC unless it says), as
    an argparse type (``--since``, ``--until``)."""
    try:
        return parse_when(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def login() -> str:
    """Who is at the terminal, for audit actors (``cli:<login>``)."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers): still say it was a person
        return "unknown"


def some_path(text: str) -> Path:
    """A file or directory path as an argparse type; an empty one is refused: ``Path("")`` is
    the current directory, so ``--workdir ""`` (an unset shell variable) wrote there."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (a shell variable left unset?)")
    return Path(text)


_MAX_COUNT = 1_000_000_000  # a count past it is a typo, and no database column binds 10**20


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= _MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to {_MAX_COUNT:,}")
    return value


def port(text: str) -> int:
    """A TCP port as an argparse type: 0 (let the system pick one) to 65535."""
    return _port(text, 0)


def fixed_port(text: str) -> int:
    """A TCP port chosen by the user, 1 to 65535 (a server that prints its own address)."""
    return _port(text, 1)


def _port(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port ({lowest} to 65535)")
    return value


def exception_line(exc: BaseException, limit: int = 500) -> str:
    """``Type: message`` of an exception on one line, escaped and cut to about ``limit``
    characters: why something failed, for a log line or a health answer, without the
    traceback (a driver's message may span lines or quote what a database row holds)."""
    message = str(exc)
    return one_line(f"{type(exc).__name__}: {message}" if message else type(exc).__name__, limit)


def one_line(text: str, limit: int = 500) -> str:
    """``text`` escaped onto one line and cut to about ``limit`` characters."""
    text = printable(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_text(value: Any, *, indent: int | None = None) -> str:
    """``value`` as JSON for stdout or an ``-o`` file, non-ASCII text as it is. Text read back
    from a damaged SQLite row (bytes that are not UTF-8) holds lone surrogates, which UTF-8
    output cannot spell: each is written as its ``\\udcxx`` escape, so the document still
    says what the row holds instead of the command failing on it. Characters a terminal acts
    on (a C1 control, a bidirectional override a model or a crafted row put in a transcript)
    are escaped too (:func:`escaped_controls`)."""
    return escaped_controls(
        escaped_surrogates(json.dumps(value, ensure_ascii=False, indent=indent))
    )


CELL_LIMIT = 1000
"""The widest table cell, in characters. Every id fits whole (256 UTF-8 bytes come to at most
768 characters once escaped); longer text read back from a store (a tool name a model made
up, a hand-edited row) is cut with "…", so that one such value cannot pad every line of the
table to its width (a 1 MB tool name made `runs show` print megabytes). ``--json`` has it all.
"""


def _cell(value: Any) -> str:
    text = printable(value)
    return text if len(text) <= CELL_LIMIT else text[: CELL_LIMIT - 1] + "…"


def id_cell(value: str | None) -> str:
    """An id (a user's, a session's) as a table shows it: see
    :func:`~loomflow._printable.shown_id`. ``--json`` gives every id as it is."""
    return shown_id(value)


def user_cell(user_id: str | None) -> str:
    """A user id as a table shows it (:func:`id_cell`): ``-`` is the anonymous user."""
    return id_cell(user_id)


def table(rows: Sequence[Sequence[Any]]) -> None:
    """Print rows (the first is the header) as left-aligned columns, each cell at most
    :data:`CELL_LIMIT` characters."""
    shown = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in shown) for i in range(len(shown[0]))]
    for row in shown:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
