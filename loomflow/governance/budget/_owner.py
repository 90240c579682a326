"""Who holds a reservation, in a form that lets a worker on the same host see it died.

The identity and liveness checks are the journal's (``loomflow.runtime._owner``), so a hold and
a lease of one process always name it the same way.
"""

from __future__ import annotations

from ...runtime._owner import is_this_process, pid_namespace, process_gone, process_owner

__all__ = ["current_owner", "owner_is_dead", "pid_namespace"]


def current_owner() -> str:
    """The calling process's owner id, read per reservation (a forked child gets its own)."""
    return process_owner()


def owner_is_dead(owner: str) -> bool:
    """True only when ``owner`` ran in our pid namespace and its process is gone.

    An id with our pid but not our process's id was left by an earlier process that had our
    (since reused) pid: that process is gone too.
    """
    return process_gone(owner) or (is_this_process(owner) and owner != process_owner())
