"""The one table of store URL schemes: which scheme each kind of store accepts.

Every place that turns a URL into a store checks it here first, so a bad scheme reads the same
everywhere. The table sits in the storage layer so that each store package can use it without
importing the composition root (``loomflow.stores``), which imports all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from ..config import _masked_url, query_in_file_url, scheme_without_slashes
from ..errors import ConfigurationError

__all__ = ["SCHEMES", "StoreKind", "check_scheme", "file_path", "scheme_of"]

StoreKind = Literal["journal", "checkpoints", "memory", "budget", "audit"]

_SQL = ("memory", "sqlite", "postgresql", "postgres")
#: The URL schemes each kind of store accepts (a bare file path counts as ``sqlite``, or as
#: ``jsonl`` when it ends in ``.jsonl``).
SCHEMES: Mapping[StoreKind, tuple[str, ...]] = {
    "journal": _SQL,
    "checkpoints": _SQL,
    "memory": _SQL,
    "budget": _SQL,
    "audit": ("memory", "jsonl", "sqlite", "postgresql", "postgres"),
}


def scheme_of(url: str) -> str:
    """The scheme of a store URL: ``memory``, ``jsonl``, ``sqlite``, ``postgresql``, ...

    A bare path is ``sqlite``, or ``jsonl`` when it ends in ``.jsonl``.

    Raises:
        ConfigurationError: ``url`` is no text, is empty, or spells a scheme without its
            ``//`` (``sqlite:x.db``).
    """
    if not isinstance(url, str):  # None was a bare AttributeError
        raise ConfigurationError(f"a store URL must be a string, not {type(url).__name__}")
    if not url.strip():  # taken as the path "": the current directory opened as SQLite
        raise ConfigurationError("the store URL is empty: use memory://, a path or a DSN")
    if url.startswith("memory:"):
        return "memory"
    if (problem := scheme_without_slashes(url)) is not None:
        raise ConfigurationError(problem)
    if "://" not in url:
        return "jsonl" if url.endswith(".jsonl") else "sqlite"
    return url.split("://", 1)[0].lower()


def check_scheme(kind: StoreKind, url: str) -> str:
    """The scheme of ``url``, if a ``kind`` store accepts it.

    Raises:
        ConfigurationError: it does not; the message lists what that kind takes.
    """
    scheme = scheme_of(url)
    accepted = SCHEMES[kind]
    if scheme not in accepted:
        listed = ", ".join(f"{s}://" for s in accepted)
        raise ConfigurationError(
            f"unknown {kind} URL scheme in {_masked_url(url)!r}: the {kind} store takes {listed} "
            "(or a bare file path)"
        )
    return scheme


def file_path(url: str, scheme: str) -> str:
    """The path a ``sqlite://`` or ``jsonl://`` URL (or a bare path) names."""
    if "://" not in url:
        return url
    path = url.split("://", 1)[1]
    if not path.startswith("/") or path == "/":
        kind = "SQLite" if scheme == "sqlite" else "JSONL"
        ext = "db" if scheme == "sqlite" else "jsonl"
        raise ConfigurationError(f"bad {kind} URL {url!r}: use {scheme}:///relative/path.{ext}")
    if (problem := query_in_file_url(url)) is not None:
        raise ConfigurationError(problem)
    return path[1:]  # x:///rel.db -> rel.db ; x:////abs/rel.db -> /abs/rel.db
