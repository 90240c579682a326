"""Fixtures of the recovery tests."""

from __future__ import annotations

from collections.abc import Iterator
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
