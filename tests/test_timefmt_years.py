"""The JSON time format keeps four year digits for the years before 1000."""

from __future__ import annotations

import datetime as dt

from loomflow._timefmt import iso_time


def test_years_before_1000_keep_their_zeros() -> None:
    assert iso_time(dt.datetime(1, 1, 1, tzinfo=dt.UTC)) == "0001-01-01T00:00:00.000000Z"
    assert iso_time(dt.datetime(999, 12, 31, 23, 59, tzinfo=dt.UTC)).startswith("0999-12-31T")
    assert iso_time(dt.datetime(2026, 5, 8, tzinfo=dt.UTC)) == "2026-05-08T00:00:00.000000Z"
