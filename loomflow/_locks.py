"""Tables of asyncio locks keyed by something unbounded (sessions, idempotency keys, forks)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, MutableMapping
from typing import TypeVar

__all__ = ["drop_if_idle"]

K = TypeVar("K", bound=Hashable)


def drop_if_idle(table: MutableMapping[K, asyncio.Lock], key: K, lock: asyncio.Lock) -> None:
    """Remove ``lock`` from ``table`` once nobody holds or awaits it: the keys are new all the
    time, and a table that kept every lock would grow for the process's life. A later
    caller makes a fresh lock for the key."""
    # asyncio.Lock has no public count of its waiters; _waiters is None or a deque.
    if not lock.locked() and not lock._waiters and table.get(key) is lock:
        del table[key]
