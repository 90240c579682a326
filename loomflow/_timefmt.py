"""The one time format of loomflow's JSON output (CLI ``--json``, ``users export``)."""

from __future__ import annotations

import datetime as dt

__all__ = ["iso_time"]


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
