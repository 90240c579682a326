"""The (session, user) turn across processes: claim, steal, heartbeat, check, release.

A run holds its turn through a lease row in the journal's database, with a fencing token
that every step write carries. This module decides when to take a turn (free, expired, or
held by a process known to be gone: see :mod:`loomflow.runtime._owner`), keeps it renewed,
and refuses to start a step's body once the turn may have passed to a newer owner. It knows
nothing of steps or replay; the journal calls it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

from .._cleanup import attach_cleanup_error, raise_if_cancelled
from ..errors import OwnershipLostError, RunCancelledError, SessionBusyError
from ..storage._answers import yes_or_no
from ._owner import is_this_process, process_gone
from ._store import Claim, JournalStore, Scope

__all__ = [
    "Adoption",
    "LeasedRun",
    "adopting",
    "adoption_of",
    "check_turn",
    "claim",
    "fenced_out",
    "heartbeat",
    "held",
    "holder_is_dead",
    "lease_clock",
    "lost_error",
    "not_started_error",
    "release",
    "turn_is_fresh",
]

log = logging.getLogger("loomflow.runtime")


class LeasedRun(Protocol):
    """What the lease logic reads and updates on an open run."""

    scope: Scope
    token: int
    epoch: int
    lost: bool
    lease_until: float
    outcome: str | None
    keep_state: bool
    cancelled: bool


# Owner ids of the leases this process's runs hold or are asking for right now. A lease row
# that names this process but is missing here was left behind by one of our runs whose release
# failed (the database was down, say): it is taken back at once, not waited out.
held: set[str] = set()
os.register_at_fork(after_in_child=held.clear)  # a child holds none of its parent's leases


# Counts while the process is stopped and while the machine sleeps, as the database's clock
# does (CLOCK_MONOTONIC pauses during suspend); Linux only, monotonic() elsewhere.
_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def lease_clock() -> float:
    """Seconds on a clock that keeps counting while the process is stopped or suspended."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


@dataclass(slots=True)
class Adoption:
    """A recoverer's claim on an orphaned run, which the run resumed in its task takes over."""

    key: str  # the scope's
    owner: str
    token: int
    taken: bool = False  # the run took the turn: later claims of the scope are ordinary


# A recoverer claims an orphaned run under an owner id of its own (kept in ``held``, so it
# reads as alive), then resumes it in this task: the run's claim takes the turn over from that
# claim at once, and only from it, by its token. A recoverer stopped past the claim's lease
# (SIGSTOP, a long pause) may find the run taken over, or even finished, by another owner:
# then the resume is fenced out, instead of waiting its turn or replaying a finished run as
# if it had recovered it. Set around the resume.
adopting: contextvars.ContextVar[Adoption | None] = contextvars.ContextVar(
    "loomflow_adopting", default=None
)


def adoption_of(scope: Scope) -> Adoption | None:
    """The recoverer's claim the run on ``scope`` opened in this task is to take over."""
    adoption = adopting.get()
    if adoption is None or adoption.key != scope.key or adoption.taken:
        return None
    return adoption


def holder_is_dead(owner: str) -> bool:
    """Whether the holder can no longer renew: its process is gone, or it is a lease of
    this process that no run here holds any more (its release failed)."""
    if is_this_process(owner):
        return owner not in held
    return process_gone(owner)


async def claim(
    store: JournalStore,
    scope: Scope,
    owner: str,
    *,
    lease_seconds: float,
    turn_timeout: float,
    deadline: float,
) -> tuple[Claim, float]:
    """Take the turn; also returns when the winning request was sent (on :func:`lease_clock`).

    Raises:
        SessionBusyError: a live holder kept the turn past ``deadline`` (``time.monotonic``).
    """
    adoption = adoption_of(scope)
    if adoption is not None:
        return await _adopt(store, scope, adoption, owner, lease_seconds)
    delay = 0.005
    while True:
        asked = lease_clock()
        got = await store.try_acquire(scope, owner, lease_seconds)
        if got is not None:
            return got, asked
        holder = await store.holder(scope)
        if holder is not None and holder_is_dead(holder[0]):
            asked = lease_clock()
            got = await store.steal(scope, holder[1], owner, lease_seconds)
            if got is not None:
                if is_this_process(holder[0]):
                    log.info("took back %s from an earlier run of this process", scope.shown)
                else:
                    log.info("took over %s from dead local owner %r", scope.shown, holder[0])
                return got, asked
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SessionBusyError(
                f"session {scope.session_id!r} of user {scope.user_id!r} is held by "
                f"{holder[0] if holder else 'another run'}; gave up after {turn_timeout:g}s"
            )
        await asyncio.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.25)


async def _adopt(
    store: JournalStore, scope: Scope, adoption: Adoption, owner: str, lease_seconds: float
) -> tuple[Claim, float]:
    """Take the turn from the recoverer's claim, if the claim's token still holds it.

    Raises:
        RunCancelledError: the run was cancelled since it was claimed.
        OwnershipLostError: another owner took the run over since it was claimed.
    """
    asked = lease_clock()
    got = await store.steal(scope, adoption.token, owner, lease_seconds)
    if got is None:
        if await store.run_status(scope) == "cancelled":
            raise RunCancelledError(scope.session_id, scope.user_id)
        raise OwnershipLostError(
            f"session {scope.session_id!r} of user {scope.user_id!r} was taken over by another "
            "owner before its recoverer resumed it (the recoverer was stopped or slow past its "
            "claim's lease); the new owner decides how it ends"
        )
    adoption.taken = True
    return got, asked


def _given_back(store: JournalStore, answer: object) -> bool:
    # Read as False, a broken store's None would end a finished run as "taken over".
    return yes_or_no(answer, store, "journal", "release", "the turn was given back")


async def release(store: JournalStore, run: LeasedRun, failure: BaseException | None) -> bool:
    """Give the turn back. If the body raised, its error stays the one the caller sees."""
    if failure is None and not run.keep_state:
        return _given_back(
            store, await store.release(run.scope, run.token, run.epoch + 1, run.outcome)
        )
    if failure is None:  # hand the turn back and change nothing else
        return _given_back(store, await store.release(run.scope, run.token, None))
    try:
        return _given_back(store, await store.release(run.scope, run.token, None))
    except Exception as exc:
        # The run's own failure is what the caller must act on; the lease this leaves
        # behind is taken back at once by the next run in this process, and by other
        # processes once it runs out. The release failure rides along, never instead.
        attach_cleanup_error(failure, exc, "giving back the session's turn")
        return True


def _renewed(store: JournalStore, answer: object) -> bool:
    # Read as False, a broken store's None would stop a run that still holds its turn: an
    # unknown answer is handled as a failed renewal (tried again while the lease lasts).
    return yes_or_no(answer, store, "journal", "renew", "the lease was renewed")


async def heartbeat(store: JournalStore, run: LeasedRun, lease_seconds: float) -> None:
    """Renew the lease every third of its length until cancelled or the turn is lost."""
    interval = lease_seconds / 3
    while True:
        await asyncio.sleep(interval)
        asked = lease_clock()
        try:
            ok = _renewed(store, await store.renew(run.scope, run.token, lease_seconds))
        except Exception:  # a blip must not kill the run; the lease has slack
            raise_if_cancelled()  # the run ended while the renewal timed out
            log.warning("lease renewal failed for %s", run.scope.shown, exc_info=True)
            continue
        if not ok:
            await fenced_out(store, run)
            _log_lost(run)
            return
        run.lease_until = max(run.lease_until, asked + lease_seconds)


def turn_is_fresh(run: LeasedRun, lease_seconds: float) -> bool:
    """True when the run surely still holds its turn: more than a third of a lease is left.

    The heartbeat renews every third of a lease, so a run that is keeping up always passes
    and pays nothing more; otherwise call :func:`check_turn` before any side effect.
    """
    return not run.lost and run.lease_until - lease_clock() > lease_seconds / 3


async def check_turn(store: JournalStore, run: LeasedRun, name: str, lease_seconds: float) -> None:
    """Refuse to start a step's body once this run may have lost its turn.

    Less than a third of a lease left means the process was stopped (SIGSTOP, a debugger, a
    long GC or swap storm) or renewals failed: ask the store, which both checks the fencing
    token and extends the lease, before any side effect.
    """
    if run.lost:
        raise await refused(store, run, name)
    remaining = run.lease_until - lease_clock()
    if remaining > lease_seconds / 3:
        return
    asked = lease_clock()
    try:
        ok = _renewed(store, await store.renew(run.scope, run.token, lease_seconds))
    except Exception:
        if remaining > 0:  # still ours for a while: a blip is not a lost turn
            log.warning("lease check failed for %s", run.scope.shown, exc_info=True)
            return
        raise
    if not ok:
        await fenced_out(store, run)
        _log_lost(run)
        raise not_started_error(
            run, name, "was taken over while this run was paused past its lease"
        )
    run.lease_until = max(run.lease_until, asked + lease_seconds)


async def fenced_out(store: JournalStore, run: LeasedRun) -> None:
    """Note that a fenced write or renewal failed, and whether a cancel is the reason.

    Read only on this rare path: a cancel bumps the token, so checking for it costs nothing
    on the steps of a run that was not cancelled.
    """
    run.lost = True
    if run.cancelled:
        return
    try:
        run.cancelled = await store.run_status(run.scope) == "cancelled"
    except Exception:  # the run is fenced out either way; the reason is a courtesy
        log.warning("could not read why %s was fenced out", run.scope.shown, exc_info=True)


async def refused(store: JournalStore, run: LeasedRun, name: str) -> OwnershipLostError:
    """The error for a step started after the run was fenced out, once the reason is known.

    The heartbeat marks the run lost before it asks the store whether a cancel was the reason
    (so that no body starts meanwhile); a step that comes in between asks too, rather than
    calling a cancel a takeover. Only on this rare path.
    """
    await fenced_out(store, run)
    return not_started_error(run, name, "now belongs to a newer run")


def _log_lost(run: LeasedRun) -> None:
    """Say why a renewal was refused: a cancel is somebody's decision, a takeover a fault."""
    if run.cancelled:
        log.warning("run on %s was cancelled; it stops at its next step", run.scope.shown)
    else:
        log.error("run on %s lost its turn to a newer owner", run.scope.shown)


def lost_error(run: LeasedRun, message: str) -> OwnershipLostError:
    """The error a fenced-out run raises: :class:`RunCancelledError` when it was cancelled."""
    if run.cancelled:
        return RunCancelledError(run.scope.session_id, run.scope.user_id)
    return OwnershipLostError(message)


def not_started_error(run: LeasedRun, name: str, why: str) -> OwnershipLostError:
    """The error for a step whose body was refused: one wording whichever check saw it first.

    The heartbeat, an earlier refused write or the check before a body may each be the first
    to learn the turn is gone; the caller needs to know the same thing either way: this body
    did not run.
    """
    return lost_error(
        run,
        f"step {name!r} was not started: session {run.scope.session_id!r} of user "
        f"{run.scope.user_id!r} {why}",
    )
