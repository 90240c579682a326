"""The recoverer: sweeps for orphaned runs and resumes them through registered agents.

One sweep reads the open runs nobody is running (:meth:`JournalRuntime.orphans`), and for each
one decides: no agent registered under its name, or a changed configuration -> left alone and
reported; an unreadable record or no attempts left -> dead letter (``failed``); otherwise
claim it (a compare-and-set on its fencing token, so of two recoverers one wins) and resume
it in a task of its own. Attempts are counted at the claim, so a worker killed while resuming
a run uses one up too; a failed attempt is retried after a backoff.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from .._ids import check_id
from .._printable import shown
from ..agent import Agent
from ..agent._agent import RECORD_OUTPUT, RECORD_WITHHELD
from ..agent.architectures import Debate, Workflow, team_hint
from ..audit import AuditLog
from ..audit.actions import RUN_DEAD_LETTER, RUN_RECOVER
from ..config import Settings
from ..errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptEntryError,
    InvalidArgumentError,
    NewerEntryError,
    OwnershipLostError,
    RunCancelledError,
    StoreUnavailableError,
    UserError,
)
from ..runtime import JournalRuntime, Orphan, OrphanClaim, decode_record
from ..runtime._identity import journal_identity
from ..runtime._journal import stored_error
from ..telemetry import Metrics

__all__ = ["Recoverable", "Recovery", "RunRef", "SweepReport", "default_backoff"]

# What a recoverer resumes: an agent, or a debate or workflow built with a name (each run of
# it records that name; see _Recoverable in loomflow.agent.architectures).
Recoverable: TypeAlias = Agent | Debate | Workflow

log = logging.getLogger("loomflow.recovery")


def default_backoff(attempt: int) -> float:
    """Seconds before retrying after failed attempt ``attempt`` (1, 2, 4, ... up to 300)."""
    return float(min(300, 2 ** max(0, attempt - 1)))


@dataclass(frozen=True, slots=True)
class RunRef:
    """One run a sweep acted on (or left alone), and why."""

    session_id: str | None
    user_id: str | None
    agent: str | None
    reason: str = ""


@dataclass(slots=True)
class SweepReport:
    """What one :meth:`Recovery.sweep` did.

    Attributes:
        resumed: Orphans claimed and now resuming (in tasks; :meth:`Recovery.wait` for them).
        unregistered: Orphans left alone: no agent is registered under the name they
            recorded, the registered agent's configuration changed, or a newer loomflow
            journaled steps of the run (``reason`` says which).
        dead_lettered: Runs marked ``failed``: out of attempts, or an unreadable record.
        claim_lost: Orphans another recoverer claimed first.
        deferred: Orphans left for the next sweep (this recoverer is at its concurrency).
        states: How many sessions were in each state when the sweep began.
    """

    resumed: list[RunRef] = field(default_factory=list)
    unregistered: list[RunRef] = field(default_factory=list)
    dead_lettered: list[RunRef] = field(default_factory=list)
    claim_lost: list[RunRef] = field(default_factory=list)
    deferred: list[RunRef] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)


class _NotAudited(Exception):
    """The audit log refused a recovery's first entry: the run was not started."""

    def __init__(self, failure: StoreUnavailableError) -> None:
        super().__init__(str(failure))
        self.failure = failure


_NEWER = (
    "its journal holds entries a newer loomflow wrote, which this one cannot read; "
    "a worker of that release resumes it"
)


# Pauses between tries to give an attempt lost to a store outage back (about 7 s in all: a
# failover or a restart of the database, not an outage of hours).
_GIVE_BACK_DELAYS = (0.5, 1.0, 2.0, 4.0)


def _given_up(orphan: Orphan) -> str:
    """Why a run out of attempts is a dead letter: how its last attempt ended, as far as its
    row tells, with the last error an attempt raised (which the dead letter replaces)."""
    why = f"gave up after {orphan.attempts} attempt{'' if orphan.attempts == 1 else 's'}"
    if orphan.abandoned:
        why += "; its worker died during the last"
        if orphan.last_error:
            why += f" (an earlier one raised {orphan.last_error})"
    elif orphan.last_error:
        why += f"; the last raised {orphan.last_error}"
    return why


class Recovery:
    """Finds runs that outlived their worker and resumes them.

    Args:
        runtime: The journal the runs are in (shared by every worker).
        agents: The agents that may be resumed, by name. A run records its agent's
            ``name``, so register each agent under it: ``{agent.name: agent}``.
        max_attempts: Claims of one run before it is given up (``failed``, a dead letter
            with its last error). A claim whose worker dies counts as an attempt too.
            Default: ``LOOMFLOW_RECOVERY_MAX_ATTEMPTS`` (5).
        backoff: Seconds before retrying after attempt ``n`` failed: a number, or a function
            of ``n`` (:func:`default_backoff`).
        interval: Seconds between sweeps in :meth:`run_forever`. Default:
            ``LOOMFLOW_RECOVERY_INTERVAL_SECONDS`` (10).
        worker_id: This recoverer's name in the audit log (actor ``worker:<id>``); by
            default ``<host>:<pid>``. Checked as ids are: at most 256 bytes in UTF-8, no
            control characters (:class:`~loomflow.errors.InvalidIdError` otherwise).
        audit: Where recoveries, dead letters and their outcomes are recorded.
        concurrency: Most runs this recoverer resumes at once; more wait for a later sweep.
        metrics: Prometheus metrics (default: prometheus-client's default registry).
        batch: Most orphans read per sweep.
        settings: Where the defaults come from (by default, ``LOOMFLOW_*``).

    A registered agent whose configuration fingerprint differs from the one the run stored
    is refused (reported in ``unregistered`` with the reason, the run left alone): its
    journaled steps were made by another configuration, and resuming them under this one
    would replay or diverge unpredictably. Deploy the old configuration under the name to
    drain such runs, or cancel them.
    """

    def __init__(
        self,
        runtime: JournalRuntime,
        agents: Mapping[str, Recoverable],
        *,
        max_attempts: int | None = None,
        backoff: float | Callable[[int], float] = default_backoff,
        interval: float | None = None,
        worker_id: str | None = None,
        audit: AuditLog | None = None,
        concurrency: int = 10,
        metrics: Metrics | None = None,
        batch: int = 100,
        settings: Settings | None = None,
    ) -> None:
        if not isinstance(runtime, JournalRuntime):
            raise UserError(
                "Recovery needs a journaled runtime (SqliteRuntime, PostgresRuntime or "
                f"InMemoryRuntime), not {runtime!r}"
            )
        if not isinstance(agents, Mapping):
            raise UserError(f"agents must be a mapping of names to agents, not {agents!r}")
        for name, agent in agents.items():
            if not isinstance(agent, Agent | Debate | Workflow):
                raise UserError(
                    f"agents[{name!r}] is not a loomflow Agent, Debate or Workflow: {agent!r}"
                    + team_hint(agent)
                )
            if agent.name is None:
                raise UserError(
                    f"agents[{name!r}] has no name, so its runs record none to be found by: "
                    f"build it with name={name!r}"
                )
            if agent.name != name:
                raise UserError(
                    f"agents[{name!r}] is named {agent.name!r}: runs record their agent's name, "
                    f"so register it as {{{agent.name!r}: agent}} (or build it with "
                    f"name={name!r})"
                )
            if agent.runtime is None:
                raise UserError(f"agents[{name!r}] has no runtime: it would journal nothing")
        if max_attempts is None or interval is None:
            s = settings or Settings()
            max_attempts = s.recovery_max_attempts if max_attempts is None else max_attempts
            interval = s.recovery_interval_seconds if interval is None else interval
        for option, value in (("max_attempts", max_attempts), ("concurrency", concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{option} must be a positive integer, not {value!r}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidArgumentError(f"batch must be a positive integer, not {batch!r}")
        if not isinstance(interval, int | float) or not interval > 0:
            raise InvalidArgumentError(f"interval must be a positive number, not {interval!r}")
        check_id("worker_id", worker_id)  # it is written to logs and the audit log's actor
        if not callable(backoff) and not (isinstance(backoff, int | float) and backoff >= 0):
            raise InvalidArgumentError(
                f"backoff must be seconds (>= 0) or a function of the attempt, not {backoff!r}"
            )
        self.runtime = runtime
        self.agents = dict(agents)
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.interval = float(interval)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.audit = audit
        self.concurrency = concurrency
        self.batch = batch
        self.metrics = metrics if metrics is not None else Metrics()
        # The journal's step and run series at 0 before the first sweep resumes anything: a
        # worker replays at once, before its first scrape, and a series born at its first
        # increments hides them from increase().
        self.metrics.prepare_backend(str(runtime.backend))
        self._tasks: dict[asyncio.Task[None], RunRef] = {}  # the runs being resumed
        self._stopping = False
        self._wake: asyncio.Event | None = None
        self._reported: set[tuple[str | None, str | None, str]] = set()
        # Runs whose journal a newer loomflow wrote: this process can never replay them.
        self._newer: set[tuple[str | None, str | None]] = set()
        self._journals_checked = False
        # Attempts of each run that this worker lost to an outage of its own stores: given
        # back (not counted toward max_attempts) up to max_attempts of them per run, so a run
        # whose every attempt breaks a store still ends as a dead letter.
        self._store_lost: dict[tuple[str | None, str | None], int] = {}
        # Of those, the ones the journal could not be told of (the run's lease was left held,
        # or the journal stayed down): this worker does not count them when it decides.
        self._owed: dict[tuple[str | None, str | None], int] = {}
        # Audit entries that ended attempts while the audit log was down, oldest first: each is
        # written (marked ``recorded_late``) before this recoverer's next entry, and at each
        # sweep, so the trail shows every attempt however its store fared at the time.
        self._unaudited: collections.deque[tuple[str, str | None, str | None, dict[str, Any]]]
        self._unaudited = collections.deque(maxlen=10_000)
        self._audit_lock: asyncio.Lock | None = None
        self.failures = 0  # resumed runs of this recoverer that raised (``worker --once``)

    @property
    def actor(self) -> str:
        """How this recoverer appears in the audit log."""
        return f"worker:{self.worker_id}"

    @property
    def active(self) -> int:
        """Runs this recoverer is resuming right now."""
        return len(self._tasks)

    @property
    def resuming(self) -> list[RunRef]:
        """The runs this recoverer is resuming right now (after a :meth:`stop` cut short:
        those it could not hand over)."""
        return [ref for task, ref in self._tasks.items() if not task.done()]

    def _delay(self, attempt: int) -> float:
        value = self.backoff(attempt) if callable(self.backoff) else self.backoff
        return max(0.0, float(value))

    # -- sweeping --------------------------------------------------------------------------

    async def sweep(self) -> SweepReport:
        """Look once for orphaned runs; claim and start resuming those this recoverer may.

        Returns at once: the runs it resumed go on in tasks (see :meth:`wait`).
        """
        try:
            return await self._sweep()
        except StoreUnavailableError as exc:
            # A journal (or audit store) that fails every sweep shows nowhere else: the
            # run-state gauge keeps its last value.
            self.metrics.store_failed(exc)
            raise

    async def _sweep(self) -> SweepReport:
        if not self._journals_checked:
            await self._check_journals()
        report = SweepReport()
        if self._unaudited:
            try:
                await self._flush_unaudited()
            except Exception:  # down still: kept for the next sweep or entry
                log.warning(
                    "%d recovery audit entries are still waiting for the audit log",
                    len(self._unaudited),
                    exc_info=True,
                )
        report.states = await self.runtime.count_states()
        self.metrics.runs_by_state(self.runtime.backend, report.states)
        if self._stopping:
            return report
        for orphan in await self.runtime.orphans(self.batch, prefer=sorted(self.agents)):
            await self._consider(orphan, report)
        return report

    async def _check_journals(self) -> None:
        # Claims are made on self.runtime and the run is resumed through the agent's runtime:
        # both must be one journal, or the resumed run would journal elsewhere.
        mine = await journal_identity(self.runtime)
        for name, agent in self.agents.items():
            theirs = agent.runtime
            if theirs is self.runtime:
                continue
            if not isinstance(theirs, JournalRuntime) or await journal_identity(theirs) != mine:
                raise ConfigurationError(
                    f"agents[{name!r}] journals to {theirs!r}, not to the journal this "
                    f"recoverer reads ({self.runtime!r}): register agents of one journal"
                )
        self._journals_checked = True

    async def _consider(self, orphan: Orphan, report: SweepReport) -> None:
        ref = RunRef(orphan.session_id, orphan.user_id, orphan.agent)
        if orphan.damage is not None:
            # Not claimable, and not ours to dead-letter: any write would have to find the
            # row by a key its columns no longer give.
            self._leave(
                report, ref, f"its session row is damaged: {orphan.damage}; repair or delete it"
            )
            return
        if (orphan.session_id, orphan.user_id) in self._newer:
            self._leave(report, ref, _NEWER)
            return
        agent = self.agents.get(orphan.agent) if orphan.agent is not None else None
        if agent is None:
            why = (
                "the run stored no agent name (opened before 0.21, by a Debate or Workflow "
                "built without name=, or by a runtime.session block)"
                if orphan.agent is None
                # Cut short: the name is read from the row, which may hold anything.
                else f"no agent registered as {shown(orphan.agent)}"
            )
            self._leave(report, ref, why)
            return
        if orphan.config is not None and orphan.config != agent.config_fingerprint():
            self._leave(
                report,
                ref,
                f"agent {shown(orphan.agent)} is registered with another configuration than the "
                "run was started with",
            )
            return
        try:
            inputs = decode_record(orphan.record)
            withheld = inputs.get(RECORD_WITHHELD)
            if withheld:
                names = " and ".join(map(str, withheld)) if isinstance(withheld, list) else "inputs"
                self._leave(
                    report,
                    ref,
                    f"its {names} held a secret (or a value the journal cannot encode) and "
                    "were not journaled; the application that "
                    "started it must resume it",
                )
                return
            wanted = inputs.get(RECORD_OUTPUT)
            if wanted != agent.default_output_contract():
                # A per-call output_type keys the run's model calls; resumed without it (or
                # with another), the run would diverge and pay for its calls again.
                what = (
                    f"output_type {wanted.get('type')!r}"
                    if isinstance(wanted, dict)
                    else "no output_type"
                )
                self._leave(
                    report,
                    ref,
                    f"the run asked for {what}, which agent {agent.name!r} does not give by "
                    "default; register an agent built with that output_type",
                )
                return
            prompt = inputs.get("prompt")
            if not isinstance(prompt, str):
                raise CorruptEntryError("the run's record holds no prompt text")
            metadata = inputs.get("metadata")
            if metadata is not None and not isinstance(metadata, dict):
                raise CorruptEntryError("the run's record holds metadata that is not a mapping")
        except NewerEntryError:
            # A rolling upgrade again: the run is sound, and a worker of that release can read
            # its record. Dead-lettered here, it would never run.
            self._leave(report, ref, _NEWER)
            return
        except CorruptEntryError as exc:
            await self._dead_letter(report, orphan, ref, f"unreadable run record: {exc}")
            return
        if orphan.attempts - self._owed.get((orphan.session_id, orphan.user_id), 0) >= (
            self.max_attempts
        ):
            await self._dead_letter(report, orphan, ref, _given_up(orphan))
            return
        if self._stopping or len(self._tasks) >= self.concurrency:
            report.deferred.append(ref)
            return
        try:
            claim = await self.runtime.claim_orphan(
                orphan, backoff=self._delay(orphan.attempts + 1)
            )
        except CorruptEntryError as exc:  # a lease row no claim can fence: this run only
            await self._dead_letter(report, orphan, ref, f"unreadable lease row: {exc}")
            return
        if claim is None:
            report.claim_lost.append(ref)
            self.metrics.recovery("claim_lost")
            return
        report.resumed.append(ref)
        self.metrics.recovery("resumed")
        self.metrics.recovery_delay(orphan.waited)
        log.info(
            "resuming session %r of user %r with agent %r (attempt %d)",
            orphan.session_id,
            orphan.user_id,
            agent.name,
            claim.attempts,
        )
        task = asyncio.create_task(
            self._resume(agent, claim, prompt, metadata, orphan.waited),
            name=f"loomflow-recover-{ref.session_id}",
        )
        self._tasks[task] = ref
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled():
            task.exception()  # retrieved (logged by _resume itself): no "never retrieved"

    def _left_to_newer(self, session_id: str, user_id: str | None, error: str) -> None:
        if len(self._newer) >= 100_000:  # bounded, as _reported is
            self._newer.clear()
        self._newer.add((session_id, user_id))
        self._reported.add((session_id, user_id, _NEWER))  # logged here, not again by _leave
        log.warning(
            "left session %r of user %r to a newer worker: %s (%s)",
            session_id,
            user_id,
            _NEWER,
            error,
        )

    def _leave(self, report: SweepReport, ref: RunRef, why: str) -> None:
        report.unregistered.append(RunRef(ref.session_id, ref.user_id, ref.agent, why))
        key = (ref.session_id, ref.user_id, why)
        if len(self._reported) >= 100_000:  # bounded memory for a worker that runs for months
            self._reported.clear()
        if key not in self._reported:  # counted and logged once per run, not every sweep
            self._reported.add(key)
            self.metrics.recovery("unregistered")
            log.warning(
                "left orphaned session %r of user %r alone: %s", ref.session_id, ref.user_id, why
            )

    async def _dead_letter(
        self, report: SweepReport, orphan: Orphan, ref: RunRef, error: str
    ) -> None:
        # As the journal stores it: the reason quotes the row's last error, which a
        # hand-edited row may make any size, and the report, log and audit say what is stored.
        error = stored_error(error)
        if not await self.runtime.dead_letter(
            orphan.session_id, orphan.user_id, error, token=orphan.token
        ):
            report.claim_lost.append(ref)
            self.metrics.recovery("claim_lost")
            return
        report.dead_lettered.append(RunRef(ref.session_id, ref.user_id, ref.agent, error))
        self.metrics.recovery("dead_lettered")
        log.error("gave up on session %r of user %r: %s", ref.session_id, ref.user_id, error)
        await self._audit(RUN_DEAD_LETTER, orphan, {"agent": orphan.agent, "error": error})

    async def _resume(
        self,
        agent: Recoverable,
        claim: OrphanClaim,
        prompt: str,
        metadata: dict[str, Any] | None,
        waited: float,
    ) -> None:
        session_id = claim.session_id
        assert session_id is not None  # agents never open a run without a session id
        outcome = "finished"
        error: str | None = None
        stopped: str | None = None  # the interruption reason of a run that stopped again
        try:
            async with self.runtime.adopt(claim):
                # Audited before anything runs: if the audit log refuses, the run is not
                # resumed (the claim is given back; see _not_audited).
                try:
                    await self._audit_ids(
                        RUN_RECOVER,
                        session_id,
                        claim.user_id,
                        {
                            "agent": agent.name,
                            "attempt": claim.attempts,
                            "waited_s": round(waited, 3),
                        },
                    )
                except StoreUnavailableError as exc:
                    raise _NotAudited(exc) from exc
                result = await agent.resume(
                    prompt, session_id=session_id, user_id=claim.user_id, metadata=metadata
                )
            if result.interrupted:  # stopped again: it waits for a person, or hit a cap
                outcome, stopped = "interrupted", result.interruption_reason
        except RunCancelledError:
            outcome = "cancelled"
        except _NotAudited as exc:
            await self._not_audited(session_id, claim, exc.failure)
            return
        except NewerEntryError as exc:
            # A rolling upgrade: a newer loomflow journaled steps this one cannot read. The
            # run is sound and a newer worker finishes it: no failed attempt, no error noted,
            # no dead letter. The claim's attempt is given back and the run made due at once
            # (for a newer worker); this recoverer leaves it alone from now on.
            outcome = "unregistered"
            error = stored_error(agent.redactor.text(f"{type(exc).__name__}: {exc}"))
            self._left_to_newer(session_id, claim.user_id, error)
            await self._quietly(self.runtime.requeue(session_id, claim.user_id))
        except StoreUnavailableError as exc:
            # One of our own stores failed (the journal's database was unreachable for a few
            # seconds, say): an outage, not a failure of the run. The attempt is given back,
            # as far as the bound allows; beyond it the attempt counts like any other.
            error = stored_error(agent.redactor.text(f"{type(exc).__name__}: {exc}"))
            if await self._lost_to_store(session_id, claim, exc, error):
                outcome = "store_unavailable"
            else:
                outcome = await self._attempt_failed(session_id, claim, error)
                if outcome != "cancelled":
                    self.failures += 1
        except OwnershipLostError as exc:
            # Another owner took the run over while this one resumed it (this worker was
            # frozen past its lease, or the application resumed the run itself): the new
            # owner decides how it ends. Not a failed attempt: no error noted, no dead letter
            # (the run may well have finished), and `worker --once` does not fail for it.
            outcome = "claim_lost"
            error = stored_error(agent.redactor.text(f"{type(exc).__name__}: {exc}"))
            log.warning(
                "session %r of user %r was taken over by another owner while this worker "
                "resumed it; the new owner decides how it ends: %s",
                session_id,
                claim.user_id,
                error,
            )
        except asyncio.CancelledError:
            # stop(): the run's lease was given back on the way out; make it due at once so
            # another worker takes it over now, not after the backoff.
            await self._quietly(self.runtime.requeue(session_id, claim.user_id))
            # Ended like any other attempt in the audit log: the claim's run.recover has its
            # closing entry, so the trail does not read as an attempt that never concluded.
            await self._quietly(
                self._audit_ids(
                    RUN_RECOVER,
                    session_id,
                    claim.user_id,
                    {"agent": agent.name, "attempt": claim.attempts, "outcome": "handed_over"},
                )
            )
            raise
        except Exception as exc:
            # Journaled as the run's last error, so the agent's redactor sees it first.
            error = stored_error(agent.redactor.text(f"{type(exc).__name__}: {exc}"))
            log.warning(
                "resumed session %r of user %r raised (attempt %d of %d): %s",
                session_id,
                claim.user_id,
                claim.attempts,
                self.max_attempts,
                error,
            )
            # A fork whose source checkpoint is gone fails the same way on every attempt:
            # given up at once, not after the backoffs of every attempt left.
            final = isinstance(exc, CheckpointNotFoundError)
            outcome = await self._attempt_failed(session_id, claim, error, final=final)
            if outcome != "cancelled":
                self.failures += 1
        self.metrics.recovery(outcome)
        payload: dict[str, Any] = {"agent": agent.name, "attempt": claim.attempts}
        payload["outcome"] = outcome
        if stopped is not None:
            payload["interruption_reason"] = stopped
        if error is not None:
            payload["error"] = error
        action = RUN_DEAD_LETTER if outcome == "dead_lettered" else RUN_RECOVER
        await self._audit_ending(action, session_id, claim.user_id, payload)

    async def _audit_ending(
        self, action: str, session_id: str, user_id: str | None, payload: dict[str, Any]
    ) -> None:
        """Record how an attempt ended, trying again for a few seconds if the audit log is
        down; after that the entry waits for it (see ``_unaudited``), and is never dropped
        while this recoverer runs."""
        for delay in (0.0, *_GIVE_BACK_DELAYS[:3]):
            await asyncio.sleep(delay)
            try:
                await self._audit_ids(action, session_id, user_id, payload)
                return
            except StoreUnavailableError:
                continue
            except Exception:  # bookkeeping after the run: the run's own outcome stands
                log.warning("recovery bookkeeping failed", exc_info=True)
                return
        self._unaudited.append((action, session_id, user_id, {**payload, "recorded_late": True}))
        log.warning(
            "the audit log refused the entry ending attempt %s of session %r of user %r; it "
            "is recorded when the audit log answers again",
            payload.get("attempt"),
            session_id,
            user_id,
        )

    async def _flush_unaudited(self) -> None:
        """Write the entries kept while the audit log was down, oldest first."""
        if self.audit is None or not self._unaudited:
            return
        if self._audit_lock is None:
            self._audit_lock = asyncio.Lock()
        async with self._audit_lock:  # one writer: two tasks must not write one entry twice
            while self._unaudited:
                # Taken off first: an entry kept while this one is written may push the
                # oldest out of the full deque, and that must not be the next unwritten one.
                kept = self._unaudited.popleft()
                action, session_id, user_id, payload = kept
                try:
                    await self.audit.record(
                        action,
                        user_id=user_id,
                        session_id=session_id,
                        actor=self.actor,
                        payload=payload,
                    )
                except BaseException:
                    self._unaudited.appendleft(kept)  # still unwritten: first in line again
                    raise

    def _outage(self, failure: StoreUnavailableError) -> None:
        """A store outage kept this worker from doing a run's work: counted, and
        ``worker --once`` exits 1 (the work was not done)."""
        self.metrics.store_failed(failure)
        self.failures += 1

    async def _not_audited(
        self, session_id: str, claim: OrphanClaim, failure: StoreUnavailableError
    ) -> None:
        """The audit log refused the recovery's entry, so the run did not start: an outage of
        the audit store, not a failure of the run. The claim is given back with its attempt
        (as a stopping worker gives it back), so an outage never makes dead letters of the
        runs it holds back; they are claimed again at the next sweep."""
        self._outage(failure)
        self.metrics.recovery("store_unavailable")  # the attempt ended, as _resume counts
        log.warning(
            "session %r of user %r was not resumed: the audit log refused its recovery entry "
            "(%s); it is claimed again at the next sweep",
            session_id,
            claim.user_id,
            failure,
        )
        await self._quietly(self.runtime.requeue(session_id, claim.user_id))

    async def _lost_to_store(
        self, session_id: str, claim: OrphanClaim, failure: StoreUnavailableError, error: str
    ) -> bool:
        """Give back an attempt that a store outage ended; False once the run has had
        ``max_attempts`` such attempts from this worker (the attempt then counts).

        The journal is told at once if it answers again within a few seconds (the attempt
        count goes down and the run is due now, for any worker); otherwise this worker
        remembers the attempt and leaves it out when it decides whether to give up."""
        key = (session_id, claim.user_id)
        lost = self._store_lost.get(key, 0)
        if lost >= self.max_attempts:
            return False
        if len(self._store_lost) >= 100_000:  # bounded, as _reported is
            self._store_lost.clear()
            self._owed.clear()
        self._store_lost[key] = lost + 1
        self._outage(failure)
        log.warning(
            "session %r of user %r was not finished: a store failed during attempt %d (%s); "
            "the attempt does not count toward max_attempts",
            session_id,
            claim.user_id,
            claim.attempts,
            error,
        )
        for delay in (0.0, *_GIVE_BACK_DELAYS):
            await asyncio.sleep(delay)
            try:
                if await self.runtime.requeue(session_id, claim.user_id):
                    return True
                break  # answered, but the run's lease is held still: remembered below
            except StoreUnavailableError:  # down still: try again after a pause
                log.debug("giving back an attempt failed", exc_info=True)
            except Exception:
                # No pause helps (a store that does not say whether it gave the attempt
                # back): remembered below, so the outage costs the run no attempt here.
                log.warning("giving back an attempt failed", exc_info=True)
                break
        self._owed[key] = self._owed.get(key, 0) + 1
        return True

    async def _attempt_failed(
        self, session_id: str, claim: OrphanClaim, error: str, *, final: bool = False
    ) -> str:
        """Record an attempt that raised, and say how it counts: ``dead_lettered`` (the last
        one, or ``final``: no attempt could do better; the run is now ``failed``),
        ``cancelled`` (cancelled while it ran: the run says so, whatever its steps raised on
        the way out) or ``retry_failed``."""
        user_id = claim.user_id
        owed = self._owed.get((session_id, user_id), 0)
        if final or claim.attempts - owed >= self.max_attempts:
            try:
                marked = await self.runtime.dead_letter(session_id, user_id, error)
            except Exception:
                log.warning("recovery bookkeeping failed", exc_info=True)
                marked = False
            if marked:
                log.error("gave up on session %r of user %r: %s", session_id, user_id, error)
                return "dead_lettered"
            # Not marked: cancelled meanwhile, or the journal failed (the run stays orphaned
            # out of attempts, and the next sweep gives it up with this error as its last).
        await self._quietly(self.runtime.note_recovery_error(session_id, user_id, error))
        try:
            [info] = await self.runtime.sessions(session_id=session_id, user_id=user_id, limit=1)
        except Exception:  # unreadable now: counted as the failure it most likely is
            return "retry_failed"
        return "cancelled" if info.state == "cancelled" else "retry_failed"

    async def _audit(self, action: str, orphan: Orphan, payload: dict[str, Any]) -> None:
        await self._audit_ids(action, orphan.session_id, orphan.user_id, payload)

    async def _audit_ids(
        self, action: str, session_id: str | None, user_id: str | None, payload: dict[str, Any]
    ) -> None:
        if self.audit is None:
            return
        await self._flush_unaudited()  # what waited for the audit log goes first
        await self.audit.record(
            action, user_id=user_id, session_id=session_id, actor=self.actor, payload=payload
        )

    @staticmethod
    async def _quietly(work: Any) -> None:
        try:
            await work
        except Exception:  # bookkeeping after the run: the run's own outcome already stands
            log.warning("recovery bookkeeping failed", exc_info=True)

    # -- lifecycle -------------------------------------------------------------------------

    async def wait(self) -> None:
        """Wait until every run this recoverer resumed has ended (finished, raised, ...)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def run_forever(self) -> None:
        """Sweep now and then every ``interval`` seconds until :meth:`stop`.

        A sweep that fails (the database is down, say) is logged and tried again next time.
        """
        self._wake = asyncio.Event()
        while not self._stopping:
            try:
                await self.sweep()
            except Exception:
                log.warning(
                    "recovery sweep failed; trying again in %gs", self.interval, exc_info=True
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)

    async def stop(self, *, grace: float = 0.0) -> None:
        """Stop taking work and give back the runs in progress.

        Runs still resuming after ``grace`` seconds are stopped at once; their leases are
        released and they are made due for recovery, so another worker takes them over
        immediately instead of after the lease runs out.

        Handing a run over writes to the journal, so a database that stopped answering holds
        this up. To bound it, cancel it (``async with asyncio.timeout(5): await
        recovery.stop()``): :attr:`resuming` then names the runs not handed over, which stay
        claimed and are taken over once their lease runs out, as if this process had died.
        """
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._tasks and grace > 0:
            await asyncio.wait(list(self._tasks), timeout=grace)
        running = list(self._tasks)
        for task in running:
            task.cancel()
        if running:
            # Not gather(): cancelled itself (a timeout around stop()), it would cancel the
            # runs again, in the middle of handing them over, and then wait for them anyway.
            await asyncio.wait(running)
        if self._unaudited:  # a last try: these are gone with this process otherwise
            try:
                await self._flush_unaudited()
            except Exception:
                log.error(
                    "%d recovery audit entries were never recorded: the audit log is down",
                    len(self._unaudited),
                    exc_info=True,
                )

    async def __aenter__(self) -> Recovery:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
