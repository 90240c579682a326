"""What every command group shares: argument types and the plain-text table."""

from __future__ import annotations

import argparse
import datetime as dt
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["duration", "iso_time", "positive_int", "table"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration(text: str) -> dt.timedelta:
    """``30m``, ``12h``, ``7d``... as an argparse type."""
    match = _DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 12h or 7d")
    return dt.timedelta(seconds=float(match[1]) * _UNITS[match[2]])


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def iso_time(when: float | dt.datetime | None) -> str | None:
    """A time for ``--json`` output, whatever the store kept (Unix seconds or a datetime):
    ISO 8601 in UTC with microseconds and ``Z``, the audit log's export format, so every
    command's JSON reads the same way."""
    if when is None:
        return None
    if isinstance(when, dt.datetime):
        moment = when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)
    else:
        try:
            moment = dt.datetime.fromtimestamp(when, dt.UTC)
        except (OverflowError, ValueError, OSError):  # a stored time no date can hold
            return str(when)
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def table(rows: Sequence[Sequence[Any]]) -> None:
    """Print rows (the first is the header) as left-aligned columns."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
