"""Turn a store URL (from settings or the command line) into a runtime."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ._journal import JournalRuntime

__all__ = ["runtime_from_url"]


def runtime_from_url(
    url: str, *, settings: Settings | None = None, **options: Any
) -> JournalRuntime:
    """Build the runtime a URL names.

    ``memory://``; ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (a bare file path
    works too); ``postgresql://…`` or ``postgres://…`` (needs the ``postgres`` extra). The
    schemes are those of :data:`loomflow.stores.SCHEMES`.
    """
    from ..stores import store_from_url  # here: the composition root imports the runtimes

    runtime: JournalRuntime = store_from_url("journal", url, settings=settings, **options)
    return runtime
