"""Who holds a reservation, in a form that lets a worker on the same host see it died."""

from __future__ import annotations

import os
import socket

from ulid import ULID

from ...runtime._journal import _PID_NAMESPACE, _pid_alive

__all__ = ["PID_NAMESPACE", "new_owner", "owner_is_dead"]

PID_NAMESPACE = _PID_NAMESPACE
"""Hash of host, boot and pid namespace: workers that see each other's pids share it."""


def new_owner() -> str:
    """``<pid namespace>:<pid>:<host>:<unique>``, the same shape the journal's leases use."""
    return f"{PID_NAMESPACE}:{os.getpid()}:{socket.gethostname()}:{ULID()}"


def owner_is_dead(owner: str) -> bool:
    """True only when ``owner`` ran in our pid namespace and its process is gone."""
    namespace, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if namespace != PID_NAMESPACE or namespace == "unknown" or not pid_text.isdigit():
        return False  # another host or container: only the lease can tell
    pid = int(pid_text)
    return pid != os.getpid() and not _pid_alive(pid)
