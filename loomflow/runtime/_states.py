"""A run's true state, derived from its session row and the liveness of its owner.

The row alone cannot tell ``running`` from ``orphaned``: a worker killed with SIGKILL leaves
its owner id and an unexpired lease behind. So the lease (on the database's clock) and, on the
same host, the owner's process (:mod:`._owner`) are both consulted.
"""

from __future__ import annotations

import math
from typing import Any

from ._lease import holder_is_dead

__all__ = ["FINAL_STATUSES", "UNREADABLE", "run_state"]

# What a session row's ``status`` column may hold besides NULL: the run's own final word.
FINAL_STATUSES = ("interrupted", "failed", "cancelled")
UNREADABLE = "unreadable"


def run_state(
    *,
    open: Any,
    owner: Any,
    lease_until: Any,
    now: float,
    status: Any,
    attempts: Any,
) -> str:
    """One of :data:`~loomflow.runtime.RUN_STATES`, or ``"unreadable"`` for a row no release
    could have written."""
    if status is not None and status not in FINAL_STATUSES:
        return UNREADABLE  # a hand-edited row: say so instead of guessing
    if owner is not None and not isinstance(owner, str):
        return UNREADABLE
    if type(attempts) is not int or type(lease_until) not in (int, float):
        return UNREADABLE
    if not math.isfinite(lease_until):  # PostgreSQL's double holds NaN and infinity
        return UNREADABLE
    if not isinstance(open, int) or open not in (0, 1):  # a bool in memory, 0 or 1 in SQL
        return UNREADABLE  # 'yes', 2, a blob: the claim refuses it, so no state fits
    # A cancel clears the owner, so a live owner is a run begun (or resumed by hand) since.
    live = owner is not None and lease_until >= now and not holder_is_dead(owner)
    if live:
        return "running"
    if status is not None:
        return str(status)
    if open:
        if owner is not None or attempts > 0:
            return "orphaned"
        return "open"
    return "finished"
