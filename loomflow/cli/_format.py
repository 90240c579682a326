"""What every command group shares: argument types and the plain-text table."""

from __future__ import annotations

import argparse
import datetime as dt
import re
from collections.abc import Sequence
from typing import Any

from .._timefmt import iso_time

__all__ = ["duration", "iso_time", "login", "positive_int", "table"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration(text: str) -> dt.timedelta:
    """``30m``, ``12h``, ``7d``... as an argparse type."""
    match = _DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 12h or 7d")
    return dt.timedelta(seconds=float(match[1]) * _UNITS[match[2]])


def login() -> str:
    """Who is at the terminal, for audit actors (``cli:<login>``)."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers): still say it was a person
        return "unknown"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def table(rows: Sequence[Sequence[Any]]) -> None:
    """Print rows (the first is the header) as left-aligned columns."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
