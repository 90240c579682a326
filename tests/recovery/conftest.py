"""Fixtures of the recovery tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from _fleet import HangingProxy


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[HangingProxy]:
    """A proxy in front of the test's PostgreSQL database that can stop answering."""
    where = urlsplit(pg_dsn)
    proxy = HangingProxy((where.hostname or "127.0.0.1", where.port or 5432))
    try:
        yield proxy
    finally:
        proxy.close()


# The journal of a test: a SQLite file, or a scratch PostgreSQL database.
@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def journal_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    return str(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "ledger.jsonl"
