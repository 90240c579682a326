"""Who holds a lease: process identity and liveness, shared by the journal and the budget.

An owner id reads ``<pid namespace>:<pid>:<host>:<unique>``. The first two fields let a
waiter on the same machine tell that a holder's process is gone (and so take its turn at
once instead of waiting out the lease); the host is for people reading ``runs list``.

Identity is read when a lease is taken, never when an object is built: a runtime or budget
made before ``fork()`` must not lend the parent's pid to the child's leases.
"""

from __future__ import annotations

import hashlib
import os
import socket

from ulid import ULID

__all__ = [
    "claim_owner",
    "is_this_process",
    "pid_alive",
    "pid_namespace",
    "process_gone",
    "process_owner",
]

# Per-process values, recomputed in a forked child (the pid is part of the cache key).
_namespace: tuple[int, str] | None = None
_process_owner: tuple[int, str] | None = None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a process that could still renew a lease."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by its parent) answers kill(0) but will never renew
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _compute_namespace() -> str:
    # Two containers may share a hostname while numbering pids separately; a pid check across
    # them would take a live owner's turn. So: host, boot and pid namespace together.
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            parts.append(fh.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        return "unknown"  # without /proc only the lease can free a dead owner's turn
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]


def pid_namespace() -> str:
    """Hash of host, boot and pid namespace: processes that see each other's pids share it."""
    global _namespace
    pid = os.getpid()
    if _namespace is None or _namespace[0] != pid:
        _namespace = (pid, _compute_namespace())
    return _namespace[1]


def claim_owner() -> str:
    """A fresh owner id for one lease, naming the calling process."""
    return f"{pid_namespace()}:{os.getpid()}:{socket.gethostname()}:{ULID()}"


def process_owner() -> str:
    """One owner id per process (the budget's reservations), made again after a fork."""
    global _process_owner
    pid = os.getpid()
    if _process_owner is None or _process_owner[0] != pid:
        _process_owner = (pid, claim_owner())
    return _process_owner[1]


def _local_pid(owner: str) -> int | None:
    """The owner's pid if it ran in our pid namespace (else its pid means nothing here)."""
    namespace, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if (
        namespace == "unknown"
        or namespace != pid_namespace()
        or not (pid_text.isascii() and pid_text.isdigit())
    ):
        return None
    pid = int(pid_text)
    # Read from a row that may be edited by hand: 0 is no process (kill(0) signals our own
    # group), and one past the pid range would raise OverflowError out of os.kill.
    return pid if 0 < pid < 2**31 else None


def is_this_process(owner: str) -> bool:
    """True when ``owner`` names the calling process (its pid, in its pid namespace)."""
    return _local_pid(owner) == os.getpid()


def process_gone(owner: str) -> bool:
    """True only when ``owner`` ran in our pid namespace, in another process that is gone."""
    pid = _local_pid(owner)
    return pid is not None and pid != os.getpid() and not pid_alive(pid)
