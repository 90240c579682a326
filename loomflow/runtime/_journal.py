"""Replay logic, written once for every backend.

A run (``runtime.session(...)``) takes the (session, user) turn, loads all of its journal
entries in one query, and then answers each ``step()`` from memory: a hit decodes the stored
value, a miss runs the function and writes one row (fenced by the run's token). Nothing here
knows which database sits underneath.

Two concerns live beside this module: taking, keeping and checking the turn
(:mod:`._lease`, on process identity from :mod:`._owner`), and telling tracers and observers
about each step (:mod:`._tracing`). What stays here is the replay path, one for ``step``,
``stream_step`` and idempotent steps: look the position up, decode it (a pickled row is
skipped, a corrupt one runs again, changed inputs are a divergence), and on a hit return the
value; otherwise check the turn, run the body, encode and size-check its result, and record it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import pickle
import re
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeVar, overload

from .._cleanup import attach_cleanup_error
from .._ids import check_id, check_key, user_label
from .._json import valid_line
from .._locks import drop_if_idle
from .._progress import OnProgress
from ..config import Settings
from ..context import reset_var
from ..errors import (
    ConfigurationError,
    CorruptEntryError,
    DuplicateStepError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    JournalEncodeError,
    NewerEntryError,
    NoActiveRunError,
    OwnershipLostError,
    PayloadTooLargeError,
    ReplayDivergenceError,
    RunCancelledError,
    SessionBusyError,
    SessionExistsError,
    UserError,
)
from ..storage import unbounded
from ..storage._answers import yes_or_no
from . import _lease, codec
from ._expect import unexpected
from ._owner import claim_owner
from ._states import UNREADABLE
from ._store import (
    RUN_STATES,
    Claim,
    EntryInfo,
    IdempotentInfo,
    JournalStore,
    LastRun,
    OrphanClaim,
    RunRecord,
    Scope,
    SessionInfo,
    StoredEntry,
    fingerprint,
    path_key,
)
from ._tracing import (
    Outcome,
    StepEvent,
    StepNote,
    StepSignals,
    StepStart,
    StepTracer,
)

__all__ = [
    "JournalRun",
    "JournalRuntime",
    "Orphan",
    "PickledEntryWarning",
    "ReplayStats",
    "StepEvent",
    "StepNote",
    "StepStart",
    "StepTracer",
]

log = logging.getLogger("loomflow.runtime")

T = TypeVar("T")
_ANY: Any = object()


class PickledEntryWarning(UserWarning):
    """Journal rows written as pickle were skipped (they replay as misses)."""


# One warning per process, as promised to operators upgrading from pickled journals.
_pickle_warned = False


def _damaged_keys(rows: list[StoredEntry]) -> list[tuple[StoredEntry, str]]:
    """Rows whose keys no step looks up (:meth:`StoredEntry.damaged`), with why: without
    this, such a row's step would silently run a second time even under ``strict_replay``.
    (A fingerprint that is text but not this release's is left alone: a journal imported
    from 0.20 keeps its own.)"""
    return [(row, why) for row in rows if (why := row.damaged()) is not None]


def _not_journaled(run: JournalRun, name: str) -> OwnershipLostError:
    """A body ran, but its result was refused: the session belongs to a newer run now."""
    return _lease.lost_error(
        run,
        f"step {name!r} ran but was not journaled: session {run.session_id!r} of user "
        f"{run.user_id!r} now belongs to a newer run",
    )


@dataclass(frozen=True, slots=True)
class Encoded:
    """A step result that comes with its stored form: ``codec.dumps(value)``, made by a step
    body that had to encode it anyway (the agent sizes a tool's outcome against
    ``max_payload_bytes``). The journal stores ``raw`` instead of encoding the value a second
    time, and the step returns ``value``. The body must not change ``value`` after encoding it.
    """

    value: Any
    raw: bytes


def _unwrapped(result: Any) -> Any:
    return result.value if type(result) is Encoded else result


def _warn_pickled_once() -> None:
    global _pickle_warned
    if _pickle_warned:
        return
    _pickle_warned = True
    warnings.warn(
        "the journal holds entries written with pickle; they are skipped and their steps run "
        "fresh. Pass serializer='pickle' to read them (this runs code from the database).",
        PickledEntryWarning,
        stacklevel=4,
    )


@dataclass(slots=True)
class ReplayStats:
    """Counters of one run, readable while it is in progress and after it ends."""

    hits: int = 0
    misses: int = 0
    divergences: int = 0
    corrupt: int = 0
    hit_steps: list[str] = field(default_factory=list)
    fresh_steps: list[str] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class JournalRun:
    """One open outermost run: its scope, epoch, fencing token and cached entries."""

    runtime: JournalRuntime
    scope: Scope
    epoch: int
    token: int
    strict: bool
    resumed: bool
    entries: dict[tuple[str, str], dict[str, StoredEntry]]
    stats: ReplayStats = field(default_factory=ReplayStats)
    lost: bool = False
    next_seq: int = 0
    occurrences: dict[tuple[tuple[str, ...], str], int] = field(default_factory=dict)
    # The (path, name) of every step this run completed or is running: a second step of one
    # name would take the first one's journal position (DuplicateStepError).
    taken: set[tuple[tuple[str, ...], str]] = field(default_factory=set)
    # When our lease surely runs out unless renewed, on _lease.lease_clock(); measured from before
    # each claim or renewal was sent, so it never overstates what the database granted.
    lease_until: float = 0.0
    # How the run ended when it returns normally: None (finished) or "interrupted". The agent
    # sets it; the release stores it as the run's status.
    outcome: str | None = None
    # Leave the run as it was found (open or closed, with its status) when the block ends
    # normally: journaling an approval decision writes into a stopped run without continuing
    # it, and must not make it look finished.
    keep_state: bool = False
    cancelled: bool = False  # fenced out by a cancel (see _lease.fenced_out)
    # A resume of a closed run replays without the turn (no lease, no commits) and takes it
    # only when a step has to run: until then ``token`` is the one it read, not one it holds.
    claimed: bool = True
    owner: str = ""  # the owner id the run claims (or claimed) the turn under
    heartbeat: asyncio.Task[None] | None = None  # renews the lease while the turn is held
    taking: asyncio.Lock | None = None  # one claim at a time for a run replaying without it
    read_status: str | None = None  # the stored status of the run it replays, as read
    closed: bool = False  # its block has ended: no step may take the turn any more
    # Bumped when the entries are read again (the turn changed hands during a replay without
    # it): a step located before that looks again.
    generation: int = 0
    # It continues a closed run (stopped for an approval or at a cap, or finished): its row is
    # opened again before its first body runs (see JournalRuntime._reopen).
    reopen: bool = False
    reopening: asyncio.Lock | None = None

    @property
    def session_id(self) -> str | None:
        return self.scope.session_id

    @property
    def user_id(self) -> str | None:
        return self.scope.user_id


@dataclass(frozen=True, slots=True)
class Orphan:
    """An open run that nobody is running, as :meth:`JournalRuntime.orphans` finds it.

    ``record`` is the encoded inputs its agent stored (decode with :func:`decode_record`);
    ``waited`` is how long it has been orphaned, as far as the row tells (since its lease ran
    out, or its retry fell due).
    """

    session_id: str | None
    user_id: str | None
    agent: str | None
    config: str | None
    record: bytes | None
    token: int
    attempts: int
    owner_dead: bool
    waited: float
    # Why the row cannot be claimed as the run it names (its ids were edited), or None.
    damage: str | None = None
    # Whether the row still names the owner of the last claim (it died or stalled holding the
    # run, rather than giving it back), and why the last attempt that raised did.
    abandoned: bool = False
    last_error: str | None = None


def _encode_record(record: RunRecord | None) -> tuple[str, str, bytes] | None:
    if record is None:
        return None
    if not isinstance(record, RunRecord):
        raise UserError(f"record must be a loomflow.runtime.RunRecord, not {record!r}")
    try:
        raw = codec.dumps(dict(record.inputs))
    except codec.UnsupportedValueError as exc:
        raise JournalEncodeError("run record", exc.type_name, "its inputs", exc.reason) from exc
    return record.agent, record.config, raw


def _newer(entry: StoredEntry) -> bool:
    """Whether a newer loomflow wrote the entry (a codec version above the one this reads)."""
    version = entry.codec_version
    return type(version) is int and version > codec.CODEC_VERSION


def decode_record(raw: bytes | None) -> dict[str, Any]:
    """The inputs a run stored, read with the journal's codec (never runs code).

    Raises:
        CorruptEntryError: the stored record is missing or is not a readable mapping.
    """
    if raw is None:
        raise CorruptEntryError("the run stored no record (opened before 0.21, or not by an agent)")
    version = _record_version(raw)
    if version > codec.CODEC_VERSION:
        raise NewerEntryError(
            f"the run's record was written by a newer codec (v{version}) than this loomflow "
            f"reads (up to v{codec.CODEC_VERSION}); upgrade this process"
        )
    try:
        value = codec.loads(raw)
    except Exception as exc:  # any damage, however crafted, is a corrupt record
        raise CorruptEntryError(f"the run's record cannot be decoded: {exc}"[:300]) from exc
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise CorruptEntryError(f"the run's record is not a mapping: {type(value).__name__}")
    return value


# A record is tagged JSON of codec version 1 with no mark; a release that writes it with a
# newer codec version begins it with this key, so that this one can tell "upgrade" from damage
# without decoding what it cannot read.
_RECORD_VERSION = re.compile(rb'\{"codec_version":([0-9]{1,9})[,}]')


def _record_version(raw: bytes) -> int:
    marked = _RECORD_VERSION.match(raw)
    return int(marked[1]) if marked else 1


@dataclass(frozen=True, slots=True)
class _Frame:
    run: JournalRun
    path: tuple[str, ...]


_frame: contextvars.ContextVar[_Frame | None] = contextvars.ContextVar(
    "loomflow_journal_frame", default=None
)


class JournalRuntime:
    """The journaled runtime; the backends subclass it and only choose a store."""

    def __init__(
        self,
        store: JournalStore,
        *,
        serializer: Literal["json", "pickle"] | None = None,
        strict_replay: bool | None = None,
        max_payload_bytes: int | None = None,
        turn_timeout: float | None = None,
        lease_seconds: float | None = None,
        auto_migrate: bool | None = None,
        settings: Settings | None = None,
    ) -> None:
        """Options left as ``None`` come from ``settings`` (by default, ``LOOMFLOW_*``)."""
        s = settings or Settings()
        self._store = store
        self.serializer = s.serializer if serializer is None else serializer
        self.strict_replay = s.strict_replay if strict_replay is None else strict_replay
        self.max_payload_bytes = (
            s.max_payload_bytes if max_payload_bytes is None else max_payload_bytes
        )
        self.turn_timeout = s.turn_timeout_seconds if turn_timeout is None else turn_timeout
        self.lease_seconds = s.lease_seconds if lease_seconds is None else lease_seconds
        self._auto_migrate = s.auto_migrate if auto_migrate is None else auto_migrate
        if self.serializer not in ("json", "pickle"):
            raise UserError(f"serializer must be 'json' or 'pickle', not {self.serializer!r}")
        for option in ("max_payload_bytes", "turn_timeout", "lease_seconds"):
            if getattr(self, option) <= 0:
                raise UserError(f"{option} must be greater than 0")
        self._locks: dict[str, asyncio.Lock] = {}
        # Idempotency keys whose step is running in this process, by (user key, key): a
        # second step with the key waits for the first and gets its result (see _key_turn).
        self._key_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._ready: asyncio.Lock | None = None
        self._pid = os.getpid()
        self._opened = False
        self._signals = StepSignals(store)
        # Runtimes found to use this one's journal: steps made here may join their runs.
        self._peers: weakref.WeakSet[JournalRuntime] = weakref.WeakSet()
        # The runs open through this object, by scope key, so that a cancel made in this
        # process stops them before their next step instead of at their next write.
        self._live: dict[str, JournalRun] = {}

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """``"memory"``, ``"sqlite"`` or ``"postgres"``: a bounded label for metrics."""
        return self._store.backend

    async def _ensure_open(self) -> None:
        if self._pid != os.getpid():
            # Forked since: the parent's turn locks (maybe held at fork time, maybe bound to its
            # event loop) are not ours. The store reconnects by itself on next use.
            self._pid = os.getpid()
            self._locks = {}
            self._key_locks = {}
            self._ready = None
        if self._opened:
            return
        if self._ready is None:
            self._ready = asyncio.Lock()
        async with self._ready:
            if not self._opened:
                await self._store.open(migrate=self._auto_migrate)
                self._opened = True

    async def open(self) -> None:
        """Connect now (and migrate, unless disabled) instead of on first use."""
        await self._ensure_open()

    async def migrate(self) -> int:
        """Apply pending schema migrations; returns the schema version now in place."""
        if not self._opened:
            # Opening with migrate=True is the migration itself (it checks nothing first).
            await self._store.open(migrate=True)
            self._opened = True
        return await self._store.migrate()

    async def close(self) -> None:
        """Close the connection (or pool) this runtime opened.

        Also when the runtime itself never connected: a store sharing its database may have.
        """
        await self._store.close()
        self._opened = False

    async def __aenter__(self) -> JournalRuntime:
        await self._ensure_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def add_observer(self, observer: Callable[[StepEvent], None]) -> None:
        """Call ``observer`` after every journaled step (telemetry and audit hook in here)."""
        self._signals.observers.append(observer)

    def add_step_tracer(self, tracer: StepTracer) -> None:
        """Wrap every journaled step of this runtime in ``tracer`` (see :data:`StepTracer`).

        A tracer that fails is logged and ignored: it never breaks a run.
        """
        self._signals.tracers.append(tracer)

    # -- runs ------------------------------------------------------------------------------

    @property
    def current_run(self) -> JournalRun | None:
        """The run open in this context on this runtime (or one it joined), if any."""
        frame = _frame.get()
        if frame is None or (
            frame.run.runtime is not self and frame.run.runtime not in self._peers
        ):
            return None
        return frame.run

    async def check_turn(self, what: str) -> None:
        """Refuse ``what`` (a write outside the journal, such as a snapshot) once the run open
        here may have lost its turn, as a step's body is refused: a process stopped past its
        lease must not write after waking over what the run's new owner wrote meanwhile.

        Free while the lease is fresh; a run that has not taken the turn (it only replayed
        so far) holds no lease to check.

        Raises:
            OwnershipLostError: another owner took the run over (``RunCancelledError``: it
                was cancelled).
        """
        run = self.current_run
        if run is None or not run.claimed:
            return
        if not _lease.turn_is_fresh(run, self.lease_seconds):
            await _lease.check_turn(self._store, run, what, self.lease_seconds)

    async def put_checkpoint(
        self, store: Any, checkpoint: Any, *, retention: int | None, name: str
    ) -> Any:
        """Store ``checkpoint`` in ``store`` (a :class:`~loomflow.checkpoints.CheckpointStore`)
        for the run open here, fenced on its turn as its steps' writes are.

        A store beside this journal (:func:`~loomflow.checkpoints.checkpoint_store_for`)
        writes only while the run's lease row holds its token, in the write itself, so a run
        that loses its turn between :meth:`check_turn` and the write stores nothing; another
        store gets the check alone. One statement as before: the fence is part of the insert.

        Raises:
            OwnershipLostError: another owner took the run over (``RunCancelledError``: it
                was cancelled); nothing was stored.
        """
        return await self._fenced_write(
            store,
            lambda token: (
                store.put(checkpoint, retention=retention)
                if token is None
                else store.put(checkpoint, retention=retention, token=token)
            ),
            name=name,
            what="snapshot",
        )

    async def record_episode(self, memory: Any, *args: Any, name: str, **kwargs: Any) -> Any:
        """Record a run's episode in ``memory`` (an :class:`~loomflow.memory.AgentMemory`)
        for the run open here, fenced on its turn as a snapshot is (:meth:`put_checkpoint`).

        A :class:`~loomflow.memory.Memory` whose SQL store shares this journal's database
        writes only while the run's lease row holds its token, in the write itself; any
        other memory gets the lease check alone. ``args`` and ``kwargs`` are what
        :meth:`~loomflow.memory.Memory.record_episode` takes.

        Raises:
            OwnershipLostError: another owner took the run over (``RunCancelledError``: it
                was cancelled); nothing was written.
        """
        # A Memory's store, looked up by name: the memory package sits above the runtime.
        store = getattr(memory, "store", memory)
        return await self._fenced_write(
            store,
            lambda token: (
                memory.record_episode(*args, **kwargs)
                if token is None
                else memory.record_episode(*args, **kwargs, token=token)
            ),
            name=name,
            what="episode",
        )

    async def _fenced_write(
        self,
        store: Any,
        write: Callable[[int | None], Awaitable[T]],
        *,
        name: str,
        what: str,
    ) -> T:
        """``write(token)`` for the run open here: the token when ``store`` shares this
        journal's database (the write is fenced on it), ``None`` otherwise (the lease check
        alone; an in-memory pair is checked just before a write that does not yield)."""
        run = self.current_run
        if run is None or not run.claimed:
            return await write(None)
        if not _lease.turn_is_fresh(run, self.lease_seconds):
            await _lease.check_turn(self._store, run, name, self.lease_seconds)
        try:
            journal_db = getattr(self._store, "db", None)
            if journal_db is not None and getattr(store, "db", None) is journal_db:
                return await write(run.token)
            owned = getattr(self._store, "_owned", None)  # the in-memory journal's check
            if owned is not None and owned(run.scope, run.token) is None:
                # The in-memory stores' writes do not yield: nothing can take over between.
                raise OwnershipLostError(f"{what} {name!r} was not written")
            return await write(None)
        except OwnershipLostError as exc:
            await _lease.fenced_out(self._store, run)
            raise _lease.lost_error(
                run,
                f"{what} {name!r} was not written: session {run.session_id!r} of user "
                f"{run.user_id!r} now belongs to a newer run",
            ) from exc

    @contextlib.asynccontextmanager
    async def session(
        self,
        session_id: str | None = None,
        user_id: str | None = None,
        *,
        resume: bool = False,
        strict_replay: bool | None = None,
        record: RunRecord | None = None,
        take_turn: bool = False,
        new_session: bool = False,
    ) -> AsyncIterator[JournalRun]:
        """Open a run on ``(session_id, user_id)`` and journal the steps made inside it.

        Runs on one (session, user) take turns, in this process and across processes that
        share the journal. Leaving the block normally closes the run and advances the
        session's epoch; leaving it by an exception keeps the run open, so running it again
        replays it. ``resume=True`` continues the session's last run even if it finished.

        A resume of a run that closed (finished or interrupted) whose turn nobody holds reads
        the run in one query and replays it without taking the turn: a replay that only hits
        writes nothing. The turn is taken when the first step has to run (and the run's
        entries are read again if another run held the turn in between). If a new run began
        on the session meanwhile, that step raises ``SessionBusyError``. ``take_turn=True``
        takes the turn before the block starts, as every other run does.

        Inside an open run on this journal, ``session()`` opens a sub-run instead (keyed under
        the enclosing run; see :meth:`subrun`), also when that run was opened by another
        runtime object on the same database (a sub-agent with a runtime of its own). The
        sub-run works for the enclosing run's user: ``user_id`` left out (``None``) means
        that user, and another user is refused.

        ``record`` (a :class:`RunRecord`) is stored with a new run so that a recoverer can
        resume it without the caller (see :mod:`loomflow.recovery`); a sub-run ignores it.

        ``new_session=True`` opens the run only if the user has never had a run on
        ``session_id`` (a fork's session), checked and claimed in one write: of processes
        racing into one new session id, one gets it and the others
        :class:`~loomflow.errors.SessionExistsError`. A sub-run ignores it.

        Raises:
            InvalidIdError: an id is empty, too long or holds a control character.
            ConfigurationError: a run on a *different* journal is open in this context; a
                sub-run cannot be keyed under it.
            ConfigurationError: a run of another user is open in this context (the sub-run's
                steps would be journaled as that user's).
        """
        scope = Scope.checked(session_id, user_id)
        frame = _frame.get()
        if frame is not None and user_id is not None and user_id != frame.run.user_id:
            # Its steps would be keyed under the enclosing run, that is under the other
            # user: stored, exported and erased as theirs, and its idempotency keys shared
            # with theirs. A mistake in the code, not one a model could fix: it stops the run
            # (as ConfigurationError does from a tool) rather than becoming a tool error.
            raise ConfigurationError(
                f"a run of {user_label(frame.run.user_id)} is open in this context, so a run "
                f"of {user_label(user_id)} cannot be opened inside it (it would journal as a "
                "sub-run of the other user's run): leave user_id out to work for the enclosing "
                "run's user, or start the run outside the other one"
            )
        if frame is not None:
            name = f"run:{session_id}"
            _check_text("sub-run name", name)
            # The occurrence is taken before the first await (joining another runtime object
            # reads both databases' identities): runs started together, say by gather(),
            # then take their positions in the order they started, on the first run and on
            # a resume alike, not in the order their joins happen to finish.
            path = _next_path(frame, name)
            if frame.run.runtime is not self:
                await self._join(frame.run.runtime)
            reset = _frame.set(_Frame(frame.run, path))
            try:
                yield frame.run
            finally:
                reset_var(_frame, reset)
            return
        await self._ensure_open()
        deadline = time.monotonic() + self.turn_timeout
        lock = self._locks.setdefault(scope.key, asyncio.Lock())
        try:
            async with asyncio.timeout(self.turn_timeout):
                await lock.acquire()
        except TimeoutError:
            raise SessionBusyError(
                f"session {session_id!r} of user {user_id!r} stayed busy in this process for "
                f"{self.turn_timeout:g}s"
            ) from None
        # A fresh id per claim, naming the process that claims: a runtime built before fork()
        # must not lend its parent's pid to the child's lease.
        owner = claim_owner()
        _lease.held.add(owner)
        try:
            encoded = _encode_record(record)
            run = None
            # A recoverer's resume takes the turn from its claim first: a replay without the
            # turn would not notice that another owner took the run over (see _lease).
            if resume and not take_turn and _lease.adoption_of(scope) is None:
                run = await self._replaying(scope, strict_replay)
            if run is None:
                if new_session and not resume:
                    claim, asked = await self._try_create(scope, owner, encoded)
                else:
                    claim, asked = (
                        (None, 0.0) if resume else await self._try_begin(scope, owner, encoded)
                    )
                began = claim is not None  # a new run, opened by the claim itself
                if claim is None:  # busy, or a run to continue: claim, then open it if need be
                    claim, asked = await _lease.claim(
                        self._store,
                        scope,
                        owner,
                        lease_seconds=self.lease_seconds,
                        turn_timeout=self.turn_timeout,
                        deadline=deadline,
                    )
                run = await self._start(scope, claim, resume, strict_replay, encoded, began)
                self._hold(run, asked)
            run.owner = owner
            self._live[scope.key] = run  # one run per scope at a time: the turn lock
            reset = _frame.set(_Frame(run, ()))
            finished = False
            failure: BaseException | None = None
            try:
                yield run
                finished = True
            except BaseException as exc:
                failure = exc
                raise
            finally:
                reset_var(_frame, reset)
                if self._live.get(scope.key) is run:
                    del self._live[scope.key]
                if run.taking is not None:
                    await self._close_replay(run, finished)
                heartbeat = run.heartbeat
                if heartbeat is not None:
                    heartbeat.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await heartbeat
                if run.claimed:
                    released = await _lease.release(self._store, run, failure)
                else:  # a replay that never had to take the turn has nothing to give back
                    released = not run.cancelled
                if not released:
                    run.lost = True
                    why = "being cancelled" if run.cancelled else "losing its turn"
                    log.warning("run on %s ended after %s", scope.shown, why)
            if finished and not released:
                await _lease.fenced_out(self._store, run)
                if run.cancelled:
                    raise RunCancelledError(session_id, user_id)
                raise OwnershipLostError(
                    f"session {session_id!r} of user {user_id!r} was taken over before the run "
                    "could be closed; the new owner decides its outcome"
                )
        finally:
            _lease.held.discard(owner)  # from here on, a row still naming it was left behind
            lock.release()
            drop_if_idle(self._locks, scope.key, lock)

    async def _try_begin(
        self, scope: Scope, owner: str, record: tuple[str, str, bytes] | None
    ) -> tuple[Claim | None, float]:
        """A new run on a free session whose last run closed: claimed and opened in one
        write. ``None`` when that is not the case (or the store cannot do it)."""
        try_begin = getattr(self._store, "try_begin", None)  # stores from before 0.21 lack it
        if try_begin is None:
            return None, 0.0
        asked = _lease.lease_clock()
        claim: Claim | None = await try_begin(scope, owner, self.lease_seconds, record)
        return claim, asked

    async def _try_create(
        self, scope: Scope, owner: str, record: tuple[str, str, bytes] | None
    ) -> tuple[Claim | None, float]:
        """A run on a session the user has no row on, claimed and opened in one write;
        :class:`SessionExistsError` if there is one. ``None`` when the store cannot do it
        (the caller checked first; the journal then claims as for any run)."""
        try_create = getattr(self._store, "try_create", None)  # stores from before 0.21 lack it
        if try_create is None:
            return None, 0.0
        asked = _lease.lease_clock()
        claim: Claim | None = await try_create(scope, owner, self.lease_seconds, record)
        if claim is None:
            raise SessionExistsError(
                f"session {scope.session_id!r} of {user_label(scope.user_id)} already has runs"
            )
        return claim, asked

    async def _start(
        self,
        scope: Scope,
        claim: Claim,
        resume: bool,
        strict: bool | None,
        record: tuple[str, str, bytes] | None = None,
        began: bool = False,
    ) -> JournalRun:
        """The run a claim gives: the last one continued, or a new one (``began``: the claim
        opened it already). A new run has nothing journaled yet, so only a continued one is
        read from the store."""
        try:
            if resume and not claim.open and claim.epoch > 0:
                cancelled = claim.cancelled
                if cancelled is None:  # a store that does not read it with the claim
                    cancelled = await self._store.run_status(scope) == "cancelled"
                if cancelled:
                    raise _cancelled_resume(scope)
                epoch = claim.epoch - 1  # continue the last, finished run
                opened = False
            else:
                if resume and not claim.open:
                    # Not an error: a resume is a run of (session, user), as the spec says. But
                    # a resume that left out or mistyped the user runs every step again.
                    log.warning(
                        "session %r of %s has no run to resume: a new run starts, and its "
                        "steps run (check the session id and user_id of the run to resume)",
                        scope.session_id,
                        user_label(scope.user_id),
                    )
                epoch = claim.epoch
                opened = began or not claim.open  # a new run: nothing of it is journaled yet
                begun = (
                    began
                    or claim.open
                    or self._said(
                        await self._store.begin_run(scope, claim.token, record),
                        "begin_run",
                        "the run was opened",
                    )
                )
                if not begun:
                    # Stopped past the lease between the claim and this write: named as
                    # the other messages name a session, never by the store's key.
                    raise OwnershipLostError(
                        f"session {scope.session_id!r} of {user_label(scope.user_id)} was "
                        "taken over before the run could be opened"
                    )
            rows = [] if opened else await self._store.load_run(scope, epoch)
            run = self._run_of(scope, epoch, claim.token, rows, strict)
            run.reopen = resume and not claim.open and claim.epoch > 0
            return run
        except BaseException as exc:
            try:
                await self._store.release(scope, claim.token, None)
            except Exception as cleanup:
                attach_cleanup_error(exc, cleanup, "giving back the session's turn")
            raise

    def _run_of(
        self,
        scope: Scope,
        epoch: int,
        token: int,
        rows: list[StoredEntry],
        strict: bool | None,
        *,
        claimed: bool = True,
    ) -> JournalRun:
        """A run of ``epoch`` over its journal rows (strict: a row no step can match raises)."""
        strict = self.strict_replay if strict is None else strict
        damaged = _damaged_keys(rows)
        if damaged and strict:
            row, why = damaged[0]
            raise CorruptEntryError(
                f"the {_where(row, epoch, scope)} has {why}: no step can match it, so its "
                "step would run again; repair or delete the row (strict_replay)"
            )
        for row, why in damaged:
            log.warning("%s has %s; its step runs again", _where(row, epoch, scope), why)
        run = JournalRun(
            runtime=self,
            scope=scope,
            epoch=epoch,
            token=token,
            strict=strict,
            resumed=bool(rows),
            entries=_indexed(rows),
            next_seq=_next_seq(rows),
            claimed=claimed,
        )
        run.stats.corrupt += len(damaged)
        return run

    def _hold(self, run: JournalRun, asked: float) -> None:
        """The run holds the turn from a claim sent at ``asked``: keep it renewed."""
        run.lease_until = asked + self.lease_seconds
        run.heartbeat = asyncio.create_task(
            _lease.heartbeat(self._store, run, self.lease_seconds),
            name="loomflow-lease",
            context=contextvars.Context(),  # not the step's: it outlives none of it
        )

    async def _replaying(self, scope: Scope, strict: bool | None) -> JournalRun | None:
        """The session's last run, to replay without taking the turn, if it is closed and
        nobody holds the turn; ``None`` to take the turn first (an open or busy session, a
        session with no finished run yet, or a store that cannot read it in one go)."""
        peek = getattr(self._store, "peek_last_run", None)  # stores from before 0.21 lack it
        last: LastRun | None = await peek(scope) if peek is not None else None
        if last is None or last.open or last.held or last.epoch == 0:
            return None
        if last.status == "cancelled":
            raise _cancelled_resume(scope)
        run = self._run_of(scope, last.epoch - 1, last.token, last.entries, strict, claimed=False)
        run.taking, run.read_status = asyncio.Lock(), last.status
        run.reopen = True
        return run

    async def _close_replay(self, run: JournalRun, finished: bool) -> None:
        """End a run that replayed without the turn (or took it late).

        A run that ended otherwise than its row says (it completed a run that had stopped to
        wait, say) takes the turn now, so that its release records how it ended. Then no
        step may take the turn any more: a step still running in another task (a parallel
        tool call the block did not wait for) would otherwise hold it after the block, with
        nobody left to give it back.
        """
        assert run.taking is not None
        settled = run.keep_state or run.outcome == run.read_status
        if finished and not run.claimed and not settled and not run.cancelled:
            try:
                await self._take_turn(run)
            except (SessionBusyError, OwnershipLostError) as exc:
                log.warning(
                    "run on %s replayed to its end, but its end could not be recorded: %s",
                    run.scope.shown,
                    exc,
                )
        async with run.taking:
            run.closed = True

    async def _take_turn(self, run: JournalRun) -> None:
        """Take the turn for a run replaying without it, now that a step has to run.

        The run goes on only if its run is still the session's last one, closed. If another
        run held the turn since the replay read the journal, the entries are read again (and
        ``run.generation`` moves on, so a step located before looks again).

        Raises:
            SessionBusyError: the turn stayed busy, or a new run began on the session.
            RunCancelledError: the run was cancelled since it was read.
        """
        assert run.taking is not None
        async with run.taking:
            if run.claimed:  # a parallel step took it first
                return
            if run.closed:
                raise OwnershipLostError(
                    f"session {run.session_id!r} of user {run.user_id!r}: the run's block has "
                    "ended, so no step of it may start any more"
                )
            seen = run.token
            claim, asked = await _lease.claim(
                self._store,
                run.scope,
                run.owner,
                lease_seconds=self.lease_seconds,
                turn_timeout=self.turn_timeout,
                deadline=time.monotonic() + self.turn_timeout,
            )
            try:
                if claim.cancelled:
                    raise _cancelled_resume(run.scope)
                if claim.open or claim.epoch != run.epoch + 1:
                    raise SessionBusyError(
                        f"a new run began on session {run.session_id!r} of user "
                        f"{run.user_id!r} while this one replayed the last run; resume again"
                    )
                rows = (
                    None
                    if claim.token == seen + 1  # nobody held the turn since the read
                    else await self._store.load_run(run.scope, run.epoch)
                )
            except BaseException as exc:
                try:
                    await self._store.release(run.scope, claim.token, None)
                except Exception as cleanup:
                    attach_cleanup_error(exc, cleanup, "giving back the session's turn")
                raise
            run.token, run.claimed = claim.token, True
            self._hold(run, asked)
            if rows is not None:
                run.entries, run.next_seq = _indexed(rows), _next_seq(rows)
                run.generation += 1

    @contextlib.contextmanager
    def subrun(self, name: str) -> Iterator[tuple[str, ...]]:
        """Key the steps made inside the block under a sub-run of the current run.

        Each use of the same ``name`` at the same level gets the next occurrence number, so two
        sequential calls to one persistent worker stay distinct and replay in order. Sub-runs
        started concurrently must use distinct names (e.g. include the tool-call slot).
        """
        frame = self._require_frame("subrun")
        _check_text("sub-run name", name)
        path = _next_path(frame, name)
        reset = _frame.set(_Frame(frame.run, path))
        try:
            yield path
        finally:
            reset_var(_frame, reset)

    async def _join(self, owner: JournalRuntime) -> None:
        """Let this runtime make steps in runs of ``owner``, if both use one journal."""
        if owner in self._peers:
            return
        from ._identity import journal_identity

        mine, theirs = await journal_identity(self), await journal_identity(owner)
        if mine != theirs:
            raise ConfigurationError(
                f"a run is open on another journal ({owner!r}), so {self!r} cannot key a "
                "sub-run under it: give the sub-agent (or worker) the enclosing agent's "
                "runtime, a runtime on the same database, or no runtime at all"
            )
        await self._ensure_open()
        self._peers.add(owner)

    def _require_frame(self, what: str) -> _Frame:
        frame = _frame.get()
        if frame is None or (
            frame.run.runtime is not self and frame.run.runtime not in self._peers
        ):
            raise NoActiveRunError(
                f"{what}() needs an open run: call it inside `async with runtime.session(...)`"
            )
        return frame

    # -- steps -----------------------------------------------------------------------------

    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> T: ...

    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> T: ...

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        idempotency_key: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once per run position, replaying its result afterwards.

        The result is journaled only after ``fn`` returns, so a crash inside ``fn`` runs it
        again on resume (at-least-once). With ``idempotency_key`` that key, scoped to the user,
        is the whole journal key: any step of the user with the same key replays the result.
        """
        frame = self._require_frame("step")
        _check_text("step name", name)
        _check_step_fn("step", name, fn)
        if idempotency_key is not None:
            _check_text("idempotency_key", idempotency_key)
        run = frame.run
        if run.lost:
            raise await _lease.refused(self._store, run, name)
        started = time.perf_counter()
        if idempotency_key is not None:  # keyed by the user's key, not by the run position
            with self._signals.traced(run, frame.path, name, False) as note:
                async with _key_turn(run, idempotency_key):
                    return await self._idempotent_step(
                        run, frame.path, name, fn, args, kwargs, idempotency_key, started, note
                    )
        position = _take_position(run, frame.path, name)
        try:
            with self._signals.traced(run, frame.path, name, False) as note:
                located = self._locate(run, frame.path, name, args, kwargs, note)
                if located[0] != "hit" and not run.claimed:
                    located = await self._with_turn(
                        run, located, frame.path, name, args, kwargs, note
                    )
                outcome, value, pkey, fp = located
                if outcome == "hit":
                    self._signals.emit(run, frame.path, name, False, "hit", started, 0.0, note)
                    return value
                result = await self._run_fresh(run, name, fn, args, kwargs)
                write_s = await self._record(run, pkey, name, fp, "step", result)
                self._signals.emit(run, frame.path, name, False, outcome, started, write_s, note)
                return _unwrapped(result)
        except BaseException:
            run.taken.discard(position)  # nothing journaled: it may be tried again
            raise

    async def stream_step(
        self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """Journal a streaming call: chunks are stored once the stream ends, replayed in order.

        ``fn(*args, **kwargs)`` must give an async iterable (or a coroutine returning one). A
        stream that fails or is abandoned before its end stores nothing.

        Raises:
            UserError: an ``idempotency_key`` was given: a stream is found again by its run
                position only (see :meth:`step` for keyed results).
        """
        if "idempotency_key" in kwargs:
            # Taken by step() as the journal key; here it used to reach fn unnoticed, and
            # the stream ran again in every run that reached it.
            raise UserError(
                f"stream_step({name!r}) takes no idempotency_key: a stream is replayed by its "
                "position in the run only. Collect the chunks in a runtime.step(..., "
                "idempotency_key=...) instead, or, if fn itself takes an argument of that "
                "name, bind it with functools.partial"
            )
        frame = self._require_frame("stream_step")
        _check_text("step name", name)
        _check_step_fn("stream_step", name, fn)
        run = frame.run
        if run.lost:
            raise await _lease.refused(self._store, run, name)
        started = time.perf_counter()
        position = _take_position(run, frame.path, name)
        try:
            with self._signals.traced(run, frame.path, name, True) as note:
                located = self._locate(run, frame.path, name, args, kwargs, note)
                if located[0] != "hit" and not run.claimed:
                    located = await self._with_turn(
                        run, located, frame.path, name, args, kwargs, note
                    )
                outcome, value, pkey, fp = located
                if outcome == "hit":
                    self._signals.emit(run, frame.path, name, True, "hit", started, 0.0, note)
                    for chunk in value:
                        yield chunk
                    return
                source = await self._run_fresh(run, name, fn, args, kwargs)
                chunks: list[Any] = []
                iterator = source.__aiter__()
                try:
                    async for chunk in iterator:
                        chunks.append(chunk)
                        yield chunk
                finally:
                    aclose = getattr(iterator, "aclose", None)
                    if aclose is not None:
                        await aclose()
                write_s = await self._record(run, pkey, name, fp, "stream", chunks)
                self._signals.emit(run, frame.path, name, True, outcome, started, write_s, note)
        except BaseException:  # failed, or abandoned before its end: nothing journaled
            run.taken.discard(position)
            raise

    async def _idempotent_step(
        self,
        run: JournalRun,
        path: tuple[str, ...],
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: str,
        started: float,
        note: StepNote | None = None,
    ) -> Any:
        """The replay path keyed by the user's idempotency key instead of the run position."""
        stored = await self._store.get_idempotent(run.scope.user_key, key)
        if stored is not None:
            outcome, value = self._read(run, stored, name, "idempotent entry %r", key)
            if outcome == "hit":
                self._signals.emit(run, path, name, False, "hit", started, 0.0, note)
                return value
        if not run.claimed:
            await self._take_turn(run)
            # Another run may have recorded the key while this one waited for the turn.
            again = await self._store.get_idempotent(run.scope.user_key, key)
            if again is not None:
                changed = again != stored
                # The row as read now is the one the replace below must find (two damaged
                # rows may read as equal entries while holding different columns).
                stored = again
                if changed:
                    outcome, value = self._read(run, stored, name, "idempotent entry %r", key)
                    if outcome == "hit":
                        self._signals.emit(run, path, name, False, "hit", started, 0.0, note)
                        return value
        result = await self._run_fresh(run, name, fn, args, kwargs)
        fmt, raw = self._encode(name, result)
        result = _unwrapped(result)
        # Replaces the unreadable entry read above, if that is what is stored.
        entry = StoredEntry(path_key(path), name, "", "step", fmt, codec.CODEC_VERSION, raw)
        t0 = time.perf_counter()
        winner = await self._store.put_idempotent(
            run.scope, run.token, key, entry, replacing=stored
        )
        write_s = time.perf_counter() - t0
        if winner is None:
            await _lease.fenced_out(self._store, run)
            raise _not_journaled(run, name)
        run.stats.misses += 1
        run.stats.fresh_steps.append(name)
        self._signals.emit(run, path, name, False, "miss", started, write_s, note)
        if winner.value != raw:  # a concurrent writer recorded the key first: its result stands
            return self._decode(winner)
        return result

    # The shared replay path: locate -> read (decode) -> run fresh -> encode -> record.

    async def _with_turn(
        self,
        run: JournalRun,
        located: tuple[Outcome, Any, str, str],
        path: tuple[str, ...],
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        note: StepNote | None,
    ) -> tuple[Outcome, Any, str, str]:
        """Take the turn for a step a replay without it must run; where the entries were
        read again meanwhile, the step looks again (another run may have journaled it)."""
        seen = run.generation
        await self._take_turn(run)
        if run.generation == seen:
            return located
        return self._locate(run, path, name, args, kwargs, note)

    def _locate(
        self,
        run: JournalRun,
        path: tuple[str, ...],
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        note: StepNote | None,
    ) -> tuple[Outcome, Any, str, str]:
        """Find the step's run position: outcome and value, and the position's keys."""
        try:
            fp = fingerprint(args, kwargs)
        except codec.UnsupportedValueError as exc:
            raise JournalEncodeError(name, exc.type_name, "its arguments", exc.reason) from exc
        pkey = path_key(path)
        _check_key_size(run, pkey, name)
        slot = run.entries.get((pkey, name))
        if not slot:
            return "miss", None, pkey, fp
        entry = slot.get(fp)
        if entry is None:
            # A newer release may fingerprint the same inputs differently: its entry is no
            # divergence to run again (what the step did would be done twice), but refused.
            newer = next((e for e in slot.values() if _newer(e)), None)
            if newer is not None:
                self._read(run, newer, name, "journal entry for step %r", name)
            stored = next(iter(slot))
            run.stats.divergences += 1
            log.warning(
                "replay divergence at step %r (path %s, epoch %d): inputs changed, running fresh",
                name,
                pkey,
                run.epoch,
            )
            if run.strict:
                self._signals.emit(
                    run, path, name, False, "divergence", time.perf_counter(), 0.0, note
                )
                raise ReplayDivergenceError(name, pkey, stored, fp)
            return "divergence", None, pkey, fp
        outcome, value = self._read(run, entry, name, "journal entry for step %r", name)
        return outcome, value, pkey, fp

    def _read(
        self, run: JournalRun, entry: StoredEntry, name: str, what: str, label: str
    ) -> tuple[Outcome, Any]:
        """Decode a stored entry into a hit, or say why the step must run again.

        A pickled entry this runtime does not read is a miss; a corrupt one is ``"corrupt"``
        (raised in strict mode). ``what % label`` names the entry in the log.
        """
        try:
            value = self._decode(entry)
        except _Skipped:
            return "miss", None
        except NewerEntryError:
            run.stats.corrupt += 1
            raise
        except CorruptEntryError as exc:
            run.stats.corrupt += 1
            if run.strict:
                raise
            # Which run, and why: a worker resumes many, and the row is there to repair.
            log.warning(
                "%s of session %r of user %r is corrupt (%s); running the step again",
                what % label,
                run.session_id,
                run.user_id,
                str(exc)[:300],
            )
            return "corrupt", None
        wanted = unexpected(name, value)
        if wanted is not None:  # well-formed, but not what this step returns (a crafted row)
            run.stats.corrupt += 1
            problem = f"{what % label} holds {type(value).__name__}, not {wanted}"
            if run.strict:
                raise CorruptEntryError(problem)
            log.warning(
                "%s in session %r of user %r; running the step again",
                problem,
                run.session_id,
                run.user_id,
            )
            return "corrupt", None
        run.stats.hits += 1
        run.stats.hit_steps.append(name)
        return "hit", value

    async def _run_fresh(
        self,
        run: JournalRun,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Check the turn (before any side effect), then call ``fn`` and await its result."""
        if not run.claimed:
            await self._take_turn(run)
        if not _lease.turn_is_fresh(run, self.lease_seconds):
            await _lease.check_turn(self._store, run, name, self.lease_seconds)
        if run.reopen and not run.keep_state:
            await self._reopen(run)
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _reopen(self, run: JournalRun) -> None:
        """Open the closed run this one continues again, before its first body runs.

        A resume of a run that stopped (for an approval, at a budget cap or ``max_turns``) or
        finished runs its steps in the run's own epoch, which its row had closed. Open, the
        row says a run is in progress: if the process dies now, the run is an orphan that a
        recovery worker resumes, not a stopped run that nobody would resume again. The run's
        release closes it as before. A write that keeps the run as it was (an approval
        decision, ``keep_state``) leaves it closed.
        """
        if run.reopening is None:
            run.reopening = asyncio.Lock()
        async with run.reopening:  # the parallel tool calls of a turn: the first one writes
            if not run.reopen:
                return
            reopen = getattr(self._store, "reopen", None)  # custom stores may lack it
            if reopen is not None and not self._said(
                await reopen(run.scope, run.token, run.epoch),
                "reopen",
                "the stopped run was opened again",
            ):
                await _lease.fenced_out(self._store, run)
                raise _lease.lost_error(
                    run,
                    f"session {run.session_id!r} of user {run.user_id!r} changed hands before "
                    "its stopped run could go on",
                )
            run.reopen = False

    def _said(self, answer: object, method: str, unknown: str) -> bool:
        return yes_or_no(answer, self._store, "journal", method, unknown)

    def _decode(self, entry: StoredEntry) -> Any:
        if entry.format == "pickle":
            if self.serializer != "pickle":
                _warn_pickled_once()
                raise _Skipped
            return _unpickle(entry.value)
        # Before the format: a newer release may write a format this one does not know.
        if _newer(entry):
            raise NewerEntryError(
                f"step {entry.name!r}: written by a newer codec (v{entry.codec_version}) than "
                f"this loomflow reads (up to v{codec.CODEC_VERSION}); upgrade this process. "
                "The step is not run again: what it did would be done twice"
            )
        if entry.format != "json":
            raise CorruptEntryError(f"step {entry.name!r}: unknown value format {entry.format!r}")
        try:
            return codec.loads(entry.value, version=entry.codec_version)
        except codec.UnknownTagError as exc:
            raise CorruptEntryError(f"step {entry.name!r}: {exc}") from exc

    def _encode(self, name: str, value: Any) -> tuple[str, bytes]:
        """The stored form of a step's result, refused past the per-step size cap."""
        if type(value) is Encoded:
            if self.serializer != "pickle":
                if len(value.raw) > self.max_payload_bytes:
                    raise PayloadTooLargeError(name, len(value.raw), self.max_payload_bytes)
                return "json", value.raw
            value = value.value
        if self.serializer == "pickle":
            try:
                fmt, raw = "pickle", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise JournalEncodeError(name, type(value).__qualname__, "its result") from exc
        else:
            try:
                fmt, raw = "json", codec.dumps(value)
            except codec.UnsupportedValueError as exc:
                raise JournalEncodeError(name, exc.type_name, "its result", exc.reason) from exc
        if len(raw) > self.max_payload_bytes:
            raise PayloadTooLargeError(name, len(raw), self.max_payload_bytes)
        return fmt, raw

    async def _record(
        self, run: JournalRun, pkey: str, name: str, fp: str, kind: str, value: Any
    ) -> float:
        """Write a fresh result at its run position (fenced); returns the write's seconds."""
        fmt, raw = self._encode(name, value)
        entry = StoredEntry(pkey, name, fp, kind, fmt, codec.CODEC_VERSION, raw, run.next_seq)
        run.next_seq += 1
        t0 = time.perf_counter()
        written = await self._store.write_entry(run.scope, run.token, run.epoch, entry)
        if not self._said(written, "write_entry", f"step {name!r} was journaled"):
            await _lease.fenced_out(self._store, run)
            raise _not_journaled(run, name)
        run.entries.setdefault((pkey, name), {})[fp] = entry
        run.stats.misses += 1
        run.stats.fresh_steps.append(name)
        return time.perf_counter() - t0

    # -- maintenance -----------------------------------------------------------------------

    async def entries(self, session_id: str | None, user_id: str | None = None) -> list[EntryInfo]:
        """Describe every journal entry of one (session, user), oldest epoch first."""
        _check_filters(session_id, user_id)
        await self._ensure_open()
        return await self._store.list_entries(session_id, user_id)

    async def idempotency_results(self, user_id: str | None) -> list[IdempotentInfo] | None:
        """Describe the results recorded under one user's idempotency keys (no values),
        oldest first; ``None`` when the store cannot list them (one written before 0.21).

        They belong to the user rather than to a run: they outlive the run that recorded
        them (see :meth:`prune`) and go with :meth:`forget_user`.
        """
        check_id("user_id", user_id)
        listing = getattr(self._store, "list_idempotent", None)  # stores from before 0.21 lack it
        if listing is None:
            return None
        await self._ensure_open()
        found: list[IdempotentInfo] = await listing(user_id)
        return found

    async def sessions(
        self,
        *,
        user_id: str | None = _ANY,
        session_id: str | None = None,
        limit: int = 100,
        state: str | None = None,
    ) -> list[SessionInfo]:
        """The journal's (session, user) pairs, most recently active first.

        ``user_id`` filters (``None`` is the anonymous bucket; leave it out for everyone);
        ``session_id`` keeps that session's pairs only (one per user who ran it); ``state``
        keeps runs in that state (one of :data:`RUN_STATES`, or ``"unreadable"``).
        Each :class:`SessionInfo` carries its run's true ``state``.

        Raises:
            InvalidArgumentError: ``state`` is not a known state.
            InvalidIdError: ``user_id`` or ``session_id`` breaks the id rules.
        """
        _check_filters(session_id, user_id)
        if state is not None and state not in (*RUN_STATES, UNREADABLE):
            raise InvalidArgumentError(
                f"state must be one of {', '.join((*RUN_STATES, UNREADABLE))}, not {state!r}"
            )
        await self._ensure_open()
        return await self._store.list_sessions(
            None if user_id is _ANY else user_id, user_id is not _ANY, limit, session_id, state
        )

    async def run_inputs(self, session_id: str, user_id: str | None) -> dict[str, Any]:
        """The inputs the last run of (session, user) stored in its record; empty when it
        stored none (opened without a record, or by a store of your own that cannot read it).

        Raises:
            CorruptEntryError: the stored record is damaged (``NewerEntryError``: a newer
                loomflow wrote it). The caller decides: a resume that needs the run's
                metadata must not go on as if the run had none.
        """
        scope = Scope.checked(session_id, user_id)
        reading = getattr(self._store, "run_record", None)  # custom stores may lack it
        if reading is None:
            return {}
        await self._ensure_open()
        raw = await reading(scope)
        return {} if raw is None else decode_record(raw)

    async def count_states(self) -> dict[str, int]:
        """How many sessions are in each run state (every state present, zeros included)."""
        await self._ensure_open()
        return await self._store.count_states()

    async def cancel(self, session_id: str, user_id: str | None = None) -> bool:
        """Cancel the open or interrupted run of (session, user), wherever it runs.

        The run is closed as ``cancelled`` at once and its fencing token bumped, and it
        raises :class:`~loomflow.errors.RunCancelledError`. Run through this runtime object, it
        starts no step after the cancel. Run elsewhere (another process, say), it learns of the
        cancel at its next journal write or lease renewal (every third of a lease): a step body
        that starts before then runs, but its result is not recorded, and no step starts after
        it. A step already under way finishes, unrecorded. An interrupted run (one that stopped
        early, e.g. to wait for approval) is cancellable too, so that nobody's later decision
        runs its tool. A cancelled run is never recovered, and ``session(resume=True)`` of it
        raises ``RunCancelledError``; a new run on the session starts afresh.

        Returns ``False`` when there is no run to cancel (finished, already cancelled).
        """
        scope = Scope.checked(session_id, user_id)
        await self._ensure_open()
        answer = await self._store.cancel(scope)
        cancelled = self._said(answer, "cancel", "the run was cancelled")
        if cancelled:
            for runtime in (self, *self._peers):
                live = runtime._live.get(scope.key)
                if live is not None:
                    live.lost = live.cancelled = True
        return cancelled

    async def orphans(self, limit: int = 100, *, prefer: Sequence[str] = ()) -> list[Orphan]:
        """Open runs nobody is running: lease expired, owner process gone, or a recovery
        retry due; those of the agents named in ``prefer`` first. For recoverers
        (:mod:`loomflow.recovery`); read-only."""
        await self._ensure_open()
        found = []
        for row in await self._store.open_runs(limit, tuple(prefer)):
            dead = row.owner is not None and _lease.holder_is_dead(row.owner)
            expired = row.owner is None or row.lease_until < row.now
            if not (dead or expired):
                continue
            since = row.retry_at if row.owner is None else row.lease_until
            found.append(
                Orphan(
                    session_id=row.session_id,
                    user_id=row.user_id,
                    agent=row.agent,
                    config=row.config,
                    record=row.record,
                    token=row.token,
                    attempts=row.attempts,
                    owner_dead=dead,
                    waited=max(0.0, row.now - since) if since > 0 else 0.0,
                    damage=row.damage,
                    abandoned=row.owner is not None,
                    last_error=getattr(row, "last_error", None),  # custom stores may lack it
                )
            )
        return found

    async def claim_orphan(self, orphan: Orphan, *, backoff: float) -> OrphanClaim | None:
        """Take an orphan's turn and count an attempt, unless someone else took it since it
        was read (``None`` then). A failed attempt is retried ``backoff`` seconds from now.

        The claim is a lease like a run's, fenced by the same token: two recoverers never
        both win it. Resume the run inside :meth:`adopt` to hand the turn to it.
        """
        await self._ensure_open()
        owner = claim_owner()
        _lease.held.add(owner)  # alive to this process from before the claim lands
        try:
            got = await self._store.claim_orphan(
                Scope(orphan.session_id, orphan.user_id),
                orphan.token,
                owner,
                self.lease_seconds,
                backoff,
                orphan.owner_dead,
            )
        except BaseException:
            _lease.held.discard(owner)
            raise
        if got is None:
            _lease.held.discard(owner)
            return None
        return OrphanClaim(got.token, got.attempts, owner, orphan.session_id, orphan.user_id)

    @contextlib.asynccontextmanager
    async def adopt(self, claim: OrphanClaim) -> AsyncIterator[None]:
        """Hand a claimed orphan's turn to the run opened inside the block (in this task).

        The run's own claim takes the turn over from the recoverer at once (no waiting out
        the lease). Leaving the block gives back the recoverer's claim if no run took it.
        """
        scope = Scope(claim.session_id, claim.user_id)
        reset = _lease.adopting.set(_lease.Adoption(scope.key, claim.owner, claim.token))
        try:
            yield
        finally:
            reset_var(_lease.adopting, reset)
            _lease.held.discard(claim.owner)
            try:  # fenced by the claim's token: a no-op once a run took the turn over
                await self._store.release(scope, claim.token, None)
            except Exception:
                log.warning("could not give back the recovery claim on %s", scope.shown)

    async def requeue(self, session_id: str | None, user_id: str | None) -> bool:
        """Make an orphan that nobody holds due for recovery at once, and give back the attempt
        its claim counted (a worker stopping hands it over; not below one attempt). False when
        no such orphan is there (its lease is held still, or the run was closed).

        Raises :class:`~loomflow.errors.StorageError` when the store answers anything but
        True or False: a recoverer must know whether the attempt was given back."""
        given = await self._store.requeue(Scope(session_id, user_id))
        return self._said(given, "requeue", "the run was made due and its attempt given back")

    async def dead_letter(
        self, session_id: str | None, user_id: str | None, error: str, *, token: int | None = None
    ) -> bool:
        """Mark the open run ``failed`` with ``error``: recovery gave up on it. False when the
        run is not there to mark (closed, cancelled, or held by someone else).

        Raises :class:`~loomflow.errors.StorageError` when the store answers anything but
        True or False: a recoverer reading it as False would leave a run it gave up on
        unaudited and try it again."""
        scope = Scope(session_id, user_id)
        marked = await self._store.dead_letter(scope, token, stored_error(error))
        return self._said(marked, "dead_letter", "the run was marked failed")

    async def note_recovery_error(
        self, session_id: str | None, user_id: str | None, error: str
    ) -> None:
        """Record why a recovery attempt failed (the run stays orphaned until its retry)."""
        await self._store.note_error(Scope(session_id, user_id), stored_error(error))

    async def prune(
        self,
        *,
        older_than: timedelta | None = None,
        session_id: str | None = _ANY,
        user_id: str | None = _ANY,
        include_open: bool = False,
        batch_size: int = 5000,
        on_progress: OnProgress | None = None,
        dry_run: bool = False,
        keep_users: Sequence[str | None] = (),
    ) -> int:
        """Delete journal entries; returns how many went (with ``dry_run``, would go).

        Filters combine: entries older than ``older_than``, of ``session_id``, of ``user_id``
        (``None`` is the anonymous bucket; leave the argument out to match every user). The
        entries of open runs (raised or crashed, still resumable) are kept unless
        ``include_open=True``. With ``older_than`` and no ``session_id``, idempotency results
        that old (of ``user_id``, if given) go too; otherwise they outlive the runs. Nothing
        of the users in ``keep_users`` goes (``None`` is the anonymous bucket): the command
        line passes the users under legal hold.

        Rows are deleted ``batch_size`` at a time, each batch its own short statement, so a
        large prune never holds the tables' locks for long; rows written after the prune began
        are left for the next one. ``on_progress(done, total)``, if given, hears ``(0, total)``
        once the rows are counted, then the running count after every batch; ``done`` only
        grows, and the last call is ``(n, n)`` with ``n`` the return value.

        Example:
            >>> await runtime.prune(older_than=timedelta(days=30), on_progress=print)
            0 12000
            5000 12000
            10000 12000
            12000 12000
            12000
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"batch_size must be a positive integer, not {batch_size!r}")
        _check_filters(session_id, user_id)
        keep = [check_id("keep_users", user) for user in keep_users]
        await self._ensure_open()
        extra: dict[str, Any] = {"keep_users": keep} if keep else {}
        if keep and not _takes(self._store.prune, "keep_users"):
            raise ConfigurationError(
                f"{type(self._store).__name__}.prune cannot keep some users' entries (a store "
                "from before 0.21): nothing was pruned"
            )
        with unbounded():  # counting and deleting over a big table may take a while
            return await self._store.prune(
                older_than_s=older_than.total_seconds() if older_than is not None else None,
                session_id=None if session_id is _ANY else session_id,
                by_session=session_id is not _ANY,
                user_id=None if user_id is _ANY else user_id,
                by_user=user_id is not _ANY,
                include_open=include_open,
                batch_size=batch_size,
                on_progress=on_progress,
                dry_run=dry_run,
                **extra,
            )

    async def forget_user(self, user_id: str | None) -> int:
        """Delete what the journal keeps about one user, for an erasure request.

        Every entry of the user's runs (open ones too), their idempotency results, and their
        session rows, except the row of a session a live run still leases (its entries go;
        the row goes with the next forget); a lease of a worker known to be dead (killed on
        this host) does not keep its row. Returns how many rows were deleted.
        """
        check_id("user_id", user_id)
        await self._ensure_open()
        if _takes(self._store.prune, "any_age"):
            # Whatever the rows' times say: a host whose clock was stepped back writes
            # entries "in the future", and an erasure must not leave them behind.
            deleted = await self._store.prune(
                older_than_s=None,
                session_id=None,
                by_session=False,
                user_id=user_id,
                by_user=True,
                include_open=True,
                batch_size=5000,
                on_progress=None,
                any_age=True,
            )
        else:  # a store from before 0.21
            deleted = await self.prune(user_id=user_id, include_open=True, older_than=timedelta(0))
        return deleted + await self._store.forget_sessions(user_id)


def stored_error(text: str) -> str:
    """A run's last error as its text column can hold it: cut, and with each NUL and lone
    surrogate (a tool's message may hold either) replaced; PostgreSQL refused the whole
    write, SQLite a surrogate, and the error was lost. Recovery reports and audits a dead
    letter's reason in this form too, so that each says what the journal stores."""
    return valid_line(text[:4000])


def _takes(method: Callable[..., Any], option: str) -> bool:
    """Whether a store's method takes ``option`` (stores written before 0.21 lack some)."""
    return option in inspect.signature(method).parameters


def _indexed(rows: list[StoredEntry]) -> dict[tuple[str, str], dict[str, StoredEntry]]:
    """A run's entries by (path, name), then fingerprint. A row that belongs to no run
    (``damage``: its epoch is not a number) is left out: it may be another run's result."""
    entries: dict[tuple[str, str], dict[str, StoredEntry]] = {}
    for row in rows:
        if row.damage is None:
            entries.setdefault((row.path, row.name), {})[row.fingerprint] = row
    return entries


def _next_seq(rows: list[StoredEntry]) -> int:
    return max((r.seq for r in rows if r.damage is None), default=-1) + 1


def _where(row: StoredEntry, epoch: int, scope: Scope) -> str:
    """The damaged journal row, named for the error or warning that reports it."""
    if row.damage is None:
        return f"journal row at position {row.seq} of run {epoch} of {scope.shown}"
    name = repr(row.name)[:80]  # any length, any type: a hand-edited row
    return f"journal row of step {name} at position {row.seq} of {scope.shown}"


def _cancelled_resume(scope: Scope) -> RunCancelledError:
    return RunCancelledError(
        scope.session_id,
        scope.user_id,
        f"session {scope.session_id!r} of user {scope.user_id!r} was cancelled; a cancelled "
        "run is not resumed (a new run of the session starts afresh)",
    )


# The idempotency keys whose step the current task (or one it was started from) is running,
# as (id of the lock's runtime, user key, key): a step nested in one with the same key must
# not wait for the step it runs inside.
_keys_held: contextvars.ContextVar[frozenset[tuple[int, str, str]]] = contextvars.ContextVar(
    "loomflow_idempotency_keys_held", default=frozenset()
)


@contextlib.asynccontextmanager
async def _key_turn(run: JournalRun, key: str) -> AsyncIterator[None]:
    """Let one step at a time run under a user's idempotency key, in this process.

    Two steps with one key started together (parallel tool calls of a turn that the model
    asked for twice, two sessions of the user) both found no stored result and both ran:
    the key's side effect happened twice, and only the stored result was shared. The second
    now waits for the first to end and then reads what it stored (if it raised, the second
    runs). The locks live on the runtime object that opened the outermost run; processes
    (and runtime objects) sharing a database still race, and the store keeps the first
    result written.
    """
    owner = run.runtime
    lock_key = (run.scope.user_key, key)
    held_key = (id(owner), *lock_key)
    held = _keys_held.get()
    if held_key in held:  # inside the step that holds the key: waiting would never end
        yield
        return
    lock = owner._key_locks.setdefault(lock_key, asyncio.Lock())
    await lock.acquire()
    token = _keys_held.set(held | {held_key})
    try:
        yield
    finally:
        reset_var(_keys_held, token)
        lock.release()
        drop_if_idle(owner._key_locks, lock_key, lock)


def run_in_context() -> JournalRun | None:
    """The journal run open in this context (on any runtime object), if any.

    A run opened inside it becomes a sub-run of it: code that opens one without naming a
    session and user (a sub-agent, a workflow) works for this run's.
    """
    frame = _frame.get()
    return None if frame is None else frame.run


def _next_path(frame: _Frame, name: str) -> tuple[str, ...]:
    """The path of the next sub-run called ``name`` under ``frame`` (its occurrence taken)."""
    counter_key = (frame.path, name)
    n = frame.run.occurrences.get(counter_key, 0)
    frame.run.occurrences[counter_key] = n + 1
    return (*frame.path, f"{name}#{n}")


def _check_filters(session_id: object, user_id: object) -> None:
    """Refuse a filter (a listing's, a prune's) that no stored id can match, as a run refuses
    it, before the store reads it: the database would fail on a NUL or a lone surrogate."""
    if session_id is not _ANY:
        check_id("session_id", session_id)
    if user_id is not _ANY:
        check_id("user_id", user_id)


def _check_text(what: str, value: object) -> None:
    check_key(what, value, optional=False)


def _check_step_fn(what: str, name: str, fn: object) -> None:
    """Refuse a step body that cannot be called, before the journal is read.

    The usual slip is ``step("charge", charge(order))``: the caller made the coroutine (or
    stream) itself, so the journal could neither run it on a miss nor leave it unrun on a hit.
    The coroutine is closed so that Python does not also warn that it was never awaited.
    """
    if callable(fn):
        return
    if inspect.iscoroutine(fn) or inspect.isasyncgen(fn) or inspect.isgenerator(fn):
        if inspect.iscoroutine(fn) or inspect.isgenerator(fn):
            fn.close()
        made = getattr(fn, "__qualname__", "fn")
        raise InvalidArgumentTypeError(
            f"{what}({name!r}, ...) takes the function and its arguments, not what calling "
            f"{made}(...) returned: write runtime.{what}({name!r}, {made}, *args, **kwargs), and "
            "the journal calls it only when the step has no result yet"
        )
    raise InvalidArgumentTypeError(
        f"{what}({name!r}, ...) takes a function to call, not a {type(fn).__name__}: write "
        f"runtime.{what}({name!r}, fn, *args, **kwargs)"
    )


# scope + sub-run path + step name of one journal row, in UTF-8 bytes. With the fingerprint
# (64), the epoch and the tuple's headers the primary key entry stays under PostgreSQL's
# 2,704-byte btree limit; deep nesting under long ids is refused here, not by the driver.
MAX_JOURNAL_KEY_BYTES = 2400


def _take_position(
    run: JournalRun, path: tuple[str, ...], name: str
) -> tuple[tuple[str, ...], str]:
    """Hold a step's run position for this run, refusing one it already holds."""
    position = (path, name)
    if position in run.taken:
        raise DuplicateStepError(name, path_key(path))
    run.taken.add(position)
    return position


def _check_key_size(run: JournalRun, pkey: str, name: str) -> None:
    size = len(run.scope.key.encode()) + len(pkey.encode()) + len(name.encode())
    if size > MAX_JOURNAL_KEY_BYTES:
        raise UserError(
            f"step {name[:60]!r}: its journal key (session id, user id, sub-run path and step "
            f"name) is {size} bytes, over the {MAX_JOURNAL_KEY_BYTES}-byte limit; use shorter "
            "ids or names, or nest fewer sub-runs"
        )


class _Skipped(Exception):
    """A stored entry that this runtime is configured not to read."""


def _unpickle(raw: bytes) -> Any:
    loads = pickle.loads  # noqa: TID251 - opt-in legacy path behind serializer="pickle"
    try:
        return loads(raw)
    except Exception as exc:
        raise CorruptEntryError(f"pickled entry cannot be loaded: {exc}") from exc
