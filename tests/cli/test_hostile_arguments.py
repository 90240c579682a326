"""Hostile values on the command line: each one a clear error, or a result that still checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli import loomflow

from loomflow.audit._entry import MIN_TIME_US, iso_time, time_us_of_text


@pytest.mark.parametrize("bound", ["--since", "--until"])
def test_an_export_filtered_from_year_one_verifies(bound: str, tmp_path: Path) -> None:
    # Before: the header said "1-01-01T00:00:00.000000Z" (strftime drops a year's zeros
    # before 1000), and both verifiers refused the export they were handed as unreadable.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    held = loomflow("--url", url, "users", "hold", "ana", "--reason", "audit test")
    assert held.returncode == 0, held.stderr
    export = tmp_path / "ana.jsonl"
    done = loomflow("--url", url, "audit", "export", bound, "0001-01-01", "-o", str(export))
    assert done.returncode == 0, done.stderr
    assert '"0001-01-01T00:00:00.000000Z"' in export.read_text().splitlines()[0]
    checked = loomflow("audit", "verify", "--file", str(export))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_audit_times_keep_the_zeros_of_early_years() -> None:
    assert iso_time(MIN_TIME_US) == "0001-01-01T00:00:00.000000Z"
    assert time_us_of_text("0999-12-31T23:59:59.999999Z") < 0
    assert iso_time(time_us_of_text("0999-12-31T23:59:59.999999Z")) == "0999-12-31T23:59:59.999999Z"
