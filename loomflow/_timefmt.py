"""The one time format of loomflow's JSON output (CLI ``--json``, ``users export``), and the
ages and times people type (CLI options, console filter boxes), read in one place so that
both refuse a hostile value the same way instead of overflowing."""

from __future__ import annotations

import datetime as dt
import math
import re
from typing import overload

from .errors import InvalidArgumentError

__all__ = [
    "MAX_AGE",
    "UNREADABLE_TIME",
    "ago",
    "holdable_seconds",
    "iso_time",
    "parse_age",
    "parse_time",
    "parse_when",
    "table_iso",
    "table_time",
]

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

MAX_AGE = dt.timedelta(days=365_000)
"""The longest age accepted (1000 years): ``now - age`` is then always a date a datetime can
hold (year 1 is the floor), and ``1e9d`` is refused rather than overflowing."""


@overload
def iso_time(when: dt.datetime) -> str: ...
@overload
def iso_time(when: float | dt.datetime | None) -> str | None: ...
def iso_time(when: float | dt.datetime | None) -> str | None:
    """A time for ``--json`` output, whatever the store kept (Unix seconds or a datetime):
    ISO 8601 in UTC with microseconds and ``Z``, the audit log's export format, so every
    command's JSON reads the same way.

    ``None`` for Unix seconds no date can hold (NaN, infinity, ``1e300``: a hand-edited row,
    or text that SQLite hands back as NaN): JSON's null, never ``"nan"`` where a reader
    expects a time."""
    if when is None:
        return None
    if isinstance(when, dt.datetime):
        moment = when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)
    else:
        try:
            if not holdable_seconds(when):
                return None
            moment = dt.datetime.fromtimestamp(when, dt.UTC)
        except (OverflowError, ValueError, OSError, TypeError):  # no number, or a C limit
            return None
    moment = moment.astimezone(dt.UTC)
    # Not strftime("%Y"): the C library writes the years before 1000 without their zeros.
    return f"{moment.year:04d}-" + moment.strftime("%m-%dT%H:%M:%S.%fZ")


UNREADABLE_TIME = "unreadable"
"""What a table shows for a stored time no date can hold (``--json`` gives null)."""


def table_time(when: float | dt.datetime | None) -> str:
    """A stored time as a table shows it, to the second (``2026-05-08 12:00:00``, in UTC):
    ``-`` for none, :data:`UNREADABLE_TIME` for Unix seconds no date can hold."""
    return "-" if when is None else table_iso(iso_time(when))


def table_iso(text: str | None) -> str:
    """A time as :func:`iso_time` gives it (a ``--json`` row's) as a table shows it."""
    return UNREADABLE_TIME if text is None else text[:19].replace("T", " ")


def parse_age(text: str) -> dt.timedelta | None:
    """``30m``, ``12h``, ``7d``, ``2w``, ``1.5h``...; None when ``text`` is not shaped like an
    age at all.

    Raises:
        InvalidArgumentError: an age longer than :data:`MAX_AGE`.
    """
    match = _AGE.match(text.strip())
    if not match:
        return None
    # float() of any run of digits is finite or inf, never an error: inf fails the bound.
    seconds = float(match[1]) * _UNITS[match[2]]
    if not seconds <= MAX_AGE.total_seconds():
        raise InvalidArgumentError(
            f"{_shown(text)} is out of range: an age can be at most "
            f"{MAX_AGE.days}d ({MAX_AGE.days // 365} years)"
        )
    return dt.timedelta(seconds=seconds)


def ago(age: dt.timedelta) -> dt.datetime:
    """The time ``age`` before now, in UTC (``age`` within :data:`MAX_AGE`)."""
    return dt.datetime.now(dt.UTC) - age


def parse_time(text: str) -> dt.datetime:
    """An ISO 8601 date or time (UTC unless it says), aware.

    Raises:
        InvalidArgumentError: not such a time, or one that falls outside the years 1-9999
            once read in UTC (``9999-12-31T23:00-05:00``), where no datetime can hold it.
    """
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgumentError(
            f"{_shown(text)} is neither a time like 2026-05-08T12:00:00Z nor an age like 24h or 7d"
        ) from None
    if when.tzinfo is None:
        return when.replace(tzinfo=dt.UTC)
    try:
        when.astimezone(dt.UTC)
    except OverflowError:
        raise InvalidArgumentError(
            f"{_shown(text)} is out of range: in UTC it falls outside the years 1 to 9999"
        ) from None
    return when


def parse_when(text: str) -> dt.datetime:
    """An age (that long ago) or an ISO 8601 date or time: a ``--since`` or ``?until=``."""
    age = parse_age(text)
    return ago(age) if age is not None else parse_time(text)


def _shown(text: str) -> str:
    # Quoted, and cut: a hostile value may be a megabyte of digits.
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "..."


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_FLOOR = (dt.datetime.min.replace(tzinfo=dt.UTC) - _EPOCH).total_seconds()
_CEILING = (dt.datetime.max.replace(tzinfo=dt.UTC) - _EPOCH).total_seconds()


def holdable_seconds(value: float) -> bool:
    """Whether Unix seconds ``value`` name a time a datetime can hold (not inf, NaN, 1e300)."""
    return math.isfinite(value) and _FLOOR <= value <= _CEILING
