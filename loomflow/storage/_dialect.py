"""The few places where SQLite and PostgreSQL SQL differ."""

from __future__ import annotations

import re

__all__ = ["POSTGRES", "SQLITE", "Dialect"]

_PLACEHOLDER = re.compile(r"\$(\d+)")


class Dialect:
    """SQL is written once with ``$n`` placeholders and a few ``{hooks}``.

    ``{now}`` is the database clock in Unix seconds (so leases and windows compare across
    hosts), ``{lock}`` a row lock for reads that guard a write (PostgreSQL ``FOR SHARE``;
    nothing on SQLite, which serialises writers itself). In DDL, ``{blob}``, ``{double}``,
    ``{bigint}``, ``{serial}`` and ``{json}`` name the column types.
    """

    def __init__(
        self, *, name: str, now: str, lock: str, types: dict[str, str], numbered: str
    ) -> None:
        self.name = name
        self.now = now
        self.lock = lock
        self.types = types
        self._numbered = numbered  # replacement for $n, e.g. r"?\1" for SQLite
        # Statements are a small fixed set, and this runs on every journal write: memoise.
        self._cache: dict[str, str] = {}

    def sql(self, text: str) -> str:
        """Fill the hooks and placeholders of a statement."""
        done = self._cache.get(text)
        if done is None:
            filled = text.replace("{now}", self.now).replace("{lock}", self.lock)
            done = _PLACEHOLDER.sub(self._numbered, filled)
            if len(self._cache) < 4096:  # dynamic SQL (prune filters) must not grow it forever
                self._cache[text] = done
        return done

    def ddl(self, text: str) -> str:
        """Fill the type names of a DDL statement."""
        return text.format(**self.types)

    def __repr__(self) -> str:
        return f"Dialect({self.name!r})"


SQLITE = Dialect(
    name="sqlite",
    # Unix seconds with millisecond precision from SQLite's own clock.
    now="((julianday('now') - 2440587.5) * 86400.0)",
    lock="",
    types={
        "blob": "BLOB",
        "double": "REAL",
        "bigint": "INTEGER",
        "serial": "INTEGER PRIMARY KEY AUTOINCREMENT",
        "json": "TEXT",
    },
    numbered=r"?\1",
)

POSTGRES = Dialect(
    name="postgres",
    now="extract(epoch from clock_timestamp())::float8",
    lock=" FOR SHARE",
    types={
        "blob": "BYTEA",
        "double": "DOUBLE PRECISION",
        "bigint": "BIGINT",
        "serial": "BIGSERIAL PRIMARY KEY",
        "json": "JSONB",
    },
    numbered=r"$\1",
)
