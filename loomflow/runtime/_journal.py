"""Replay logic, written once for every backend.

A run (``runtime.session(...)``) takes the (session, user) turn, loads all of its journal
entries in one query, and then answers each ``step()`` from memory: a hit decodes the stored
value, a miss runs the function and writes one row (fenced by the run's token). Nothing here
knows which database sits underneath.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import pickle
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeAlias, TypeVar, overload

from .._cleanup import attach_cleanup_error
from .._ids import check_key
from .._progress import OnProgress
from ..config import Settings
from ..errors import (
    ConfigurationError,
    CorruptEntryError,
    JournalEncodeError,
    NoActiveRunError,
    OwnershipLostError,
    PayloadTooLargeError,
    ReplayDivergenceError,
    SessionBusyError,
    UserError,
)
from . import codec
from ._owner import claim_owner, is_this_process, process_gone
from ._store import (
    Claim,
    EntryInfo,
    JournalStore,
    Scope,
    SessionInfo,
    StoredEntry,
    fingerprint,
    path_key,
)

__all__ = [
    "JournalRun",
    "JournalRuntime",
    "PickledEntryWarning",
    "ReplayStats",
    "StepEvent",
    "StepNote",
    "StepStart",
    "StepTracer",
]

log = logging.getLogger("loomflow.runtime")

T = TypeVar("T")
Outcome = Literal["hit", "miss", "divergence", "corrupt"]
_ANY: Any = object()


class PickledEntryWarning(UserWarning):
    """Journal rows written as pickle were skipped (they replay as misses)."""


# One warning per process, as promised to operators upgrading from pickled journals.
_pickle_warned = False


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


def step_kind(name: str) -> str:
    """Classify a step by its name, for metrics and spans (bounded set of values)."""
    if name.startswith("model_call"):
        return "model"
    if name.startswith("tool_call"):
        return "tool"
    if name.startswith(("persist_", "memory_")):
        return "memory"
    return "custom"


@dataclass(frozen=True, slots=True)
class StepEvent:
    """What happened at one journaled step; handed to observers (telemetry, audit)."""

    backend: str
    session_id: str | None
    user_id: str | None
    epoch: int
    path: tuple[str, ...]
    name: str
    kind: str
    stream: bool
    outcome: Outcome
    duration_s: float
    write_s: float


@dataclass(frozen=True, slots=True)
class StepStart:
    """A journaled step about to be looked up and (maybe) run; handed to step tracers."""

    backend: str
    session_id: str | None
    user_id: str | None
    epoch: int
    path: tuple[str, ...]
    name: str
    kind: str
    stream: bool


StepNote: TypeAlias = Callable[[StepEvent], None]

StepTracer: TypeAlias = Callable[[StepStart], contextlib.AbstractContextManager[StepNote | None]]
"""Wraps one journaled step (telemetry opens a span here; the runtime imports no tracing).

``tracer(start)`` is entered before the journal lookup and left when the step ends, with the
step's exception if it raised. What it yields, if callable, gets the step's :class:`StepEvent`
(hit, miss, divergence, timings) before the observers do. A stream step stays inside the block
until its stream ends or is abandoned, across its yields, so a tracer must not make anything
"current" in ``contextvars`` for a stream step.
"""

# Shared by every untraced step (nullcontext is reusable): no allocation on the hot path.
_UNTRACED: contextlib.AbstractContextManager[StepNote | None] = contextlib.nullcontext()


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
    # When our lease surely runs out unless renewed, on _lease_clock(); measured from before
    # each claim or renewal was sent, so it never overstates what the database granted.
    lease_until: float = 0.0

    @property
    def session_id(self) -> str | None:
        return self.scope.session_id

    @property
    def user_id(self) -> str | None:
        return self.scope.user_id


@dataclass(frozen=True, slots=True)
class _Frame:
    run: JournalRun
    path: tuple[str, ...]


_frame: contextvars.ContextVar[_Frame | None] = contextvars.ContextVar(
    "loomflow_journal_frame", default=None
)


# Owner ids of the leases this process's runs hold or are asking for right now. A lease row
# that names this process but is missing here was left behind by one of our runs whose release
# failed (the database was down, say): it is taken back at once, not waited out.
_held: set[str] = set()
os.register_at_fork(after_in_child=_held.clear)  # a child holds none of its parent's leases


# Counts while the process is stopped and while the machine sleeps, as the database's clock
# does (CLOCK_MONOTONIC pauses during suspend); Linux only, monotonic() elsewhere.
_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def _lease_clock() -> float:
    """Seconds on a clock that keeps counting while the process is stopped or suspended."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


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
        self._ready: asyncio.Lock | None = None
        self._pid = os.getpid()
        self._opened = False
        self._observers: list[Callable[[StepEvent], None]] = []
        self._tracers: list[StepTracer] = []
        # Runtimes found to use this one's journal: steps made here may join their runs.
        self._peers: weakref.WeakSet[JournalRuntime] = weakref.WeakSet()

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
        self._observers.append(observer)

    def add_step_tracer(self, tracer: StepTracer) -> None:
        """Wrap every journaled step of this runtime in ``tracer`` (see :data:`StepTracer`).

        A tracer that fails is logged and ignored: it never breaks a run.
        """
        self._tracers.append(tracer)

    def _traced(
        self, run: JournalRun, path: tuple[str, ...], name: str, stream: bool
    ) -> contextlib.AbstractContextManager[StepNote | None]:
        if not self._tracers:
            return _UNTRACED
        start = StepStart(
            backend=self.backend,
            session_id=run.session_id,
            user_id=run.user_id,
            epoch=run.epoch,
            path=path,
            name=name,
            kind=step_kind(name),
            stream=stream,
        )
        return _tracing(self._tracers, start)

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

    @contextlib.asynccontextmanager
    async def session(
        self,
        session_id: str | None = None,
        user_id: str | None = None,
        *,
        resume: bool = False,
        strict_replay: bool | None = None,
    ) -> AsyncIterator[JournalRun]:
        """Open a run on ``(session_id, user_id)`` and journal the steps made inside it.

        Runs on one (session, user) take turns, in this process and across processes that
        share the journal. Leaving the block normally closes the run and advances the
        session's epoch; leaving it by an exception keeps the run open, so running it again
        replays it. ``resume=True`` continues the session's last run even if it finished.

        Inside an open run on this journal, ``session()`` opens a sub-run instead (keyed under
        the enclosing run; see :meth:`subrun`), also when that run was opened by another
        runtime object on the same database (a sub-agent with a runtime of its own).

        Raises:
            InvalidIdError: an id is empty, too long or holds a control character.
            ConfigurationError: a run on a *different* journal is open in this context; a
                sub-run cannot be keyed under it.
        """
        scope = Scope.checked(session_id, user_id)
        frame = _frame.get()
        if frame is not None and frame.run.runtime is not self:
            await self._join(frame.run.runtime)
        if frame is not None:
            with self.subrun(f"run:{session_id}"):
                yield frame.run
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
        _held.add(owner)
        try:
            claim, asked = await self._claim(scope, deadline, owner)
            run = await self._start(scope, claim, resume, strict_replay)
            run.lease_until = asked + self.lease_seconds
            heartbeat = asyncio.create_task(self._heartbeat(run), name="loomflow-lease")
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
                _frame.reset(reset)
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
                released = await self._release(run, failure)
                if not released:
                    run.lost = True
                    log.warning("run on %s ended after losing its turn", scope.key)
            if finished and not released:
                raise OwnershipLostError(
                    f"session {session_id!r} of user {user_id!r} was taken over before the run "
                    "could be closed; the new owner decides its outcome"
                )
        finally:
            _held.discard(owner)  # from here on, a row still naming it was left behind
            lock.release()
            if not lock.locked() and not lock._waiters:  # drop idle locks: sessions are unbounded
                self._locks.pop(scope.key, None)

    async def _release(self, run: JournalRun, failure: BaseException | None) -> bool:
        """Give the turn back. If the body raised, its error stays the one the caller sees."""
        if failure is None:
            return await self._store.release(run.scope, run.token, run.epoch + 1)
        try:
            return await self._store.release(run.scope, run.token, None)
        except Exception as exc:
            # The run's own failure is what the caller must act on; the lease this leaves
            # behind is taken back at once by the next run in this process, and by other
            # processes once it runs out. The release failure rides along, never instead.
            attach_cleanup_error(failure, exc, "giving back the session's turn")
            return True

    async def _claim(self, scope: Scope, deadline: float, owner: str) -> tuple[Claim, float]:
        """Take the turn; also returns when the winning request was sent (on _lease_clock)."""
        delay = 0.005
        while True:
            asked = _lease_clock()
            claim = await self._store.try_acquire(scope, owner, self.lease_seconds)
            if claim is not None:
                return claim, asked
            holder = await self._store.holder(scope)
            if holder is not None and self._holder_is_dead(holder[0]):
                asked = _lease_clock()
                claim = await self._store.steal(scope, holder[1], owner, self.lease_seconds)
                if claim is not None:
                    if is_this_process(holder[0]):
                        log.info("took back %s from an earlier run of this process", scope.key)
                    else:
                        log.info("took over %s from dead local owner %s", scope.key, holder[0])
                    return claim, asked
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SessionBusyError(
                    f"session {scope.session_id!r} of user {scope.user_id!r} is held by "
                    f"{holder[0] if holder else 'another run'}; gave up after "
                    f"{self.turn_timeout:g}s"
                )
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.25)

    def _holder_is_dead(self, owner: str) -> bool:
        """Whether the holder can no longer renew: its process is gone, or it is a lease of
        this process that no run here holds any more (its release failed)."""
        if is_this_process(owner):
            return owner not in _held
        return process_gone(owner)

    async def _start(
        self, scope: Scope, claim: Claim, resume: bool, strict: bool | None
    ) -> JournalRun:
        try:
            if resume and not claim.open and claim.epoch > 0:
                epoch = claim.epoch - 1  # continue the last, finished run
            else:
                epoch = claim.epoch
                if not claim.open and not await self._store.begin_run(scope, claim.token):
                    raise OwnershipLostError(f"lost {scope.key} while opening the run")
            rows = await self._store.load_run(scope, epoch)
        except BaseException as exc:
            try:
                await self._store.release(scope, claim.token, None)
            except Exception as cleanup:
                attach_cleanup_error(exc, cleanup, "giving back the session's turn")
            raise
        entries: dict[tuple[str, str], dict[str, StoredEntry]] = {}
        for row in rows:
            entries.setdefault((row.path, row.name), {})[row.fingerprint] = row
        return JournalRun(
            runtime=self,
            scope=scope,
            epoch=epoch,
            token=claim.token,
            strict=self.strict_replay if strict is None else strict,
            resumed=bool(rows),
            entries=entries,
            next_seq=max((r.seq for r in rows), default=-1) + 1,
        )

    async def _heartbeat(self, run: JournalRun) -> None:
        interval = self.lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            asked = _lease_clock()
            try:
                ok = await self._store.renew(run.scope, run.token, self.lease_seconds)
            except Exception:  # a blip must not kill the run; the lease has slack
                log.warning("lease renewal failed for %s", run.scope.key, exc_info=True)
                continue
            if not ok:
                run.lost = True
                log.error("run on %s lost its turn to a newer owner", run.scope.key)
                return
            run.lease_until = max(run.lease_until, asked + self.lease_seconds)

    async def _check_turn(self, run: JournalRun, name: str) -> None:
        """Refuse to start a step's body once this run may have lost its turn.

        The heartbeat renews every third of a lease, so a run that is keeping up always has
        more than a third left and pays nothing here. Less means the process was stopped
        (SIGSTOP, a debugger, a long GC or swap storm) or renewals failed: ask the store,
        which both checks the fencing token and extends the lease, before any side effect.
        """
        if run.lost:
            raise OwnershipLostError(f"step {name!r}: this run lost its turn to a newer owner")
        remaining = run.lease_until - _lease_clock()
        if remaining > self.lease_seconds / 3:
            return
        asked = _lease_clock()
        try:
            ok = await self._store.renew(run.scope, run.token, self.lease_seconds)
        except Exception:
            if remaining > 0:  # still ours for a while: a blip is not a lost turn
                log.warning("lease check failed for %s", run.scope.key, exc_info=True)
                return
            raise
        if not ok:
            run.lost = True
            log.error("run on %s lost its turn to a newer owner", run.scope.key)
            raise OwnershipLostError(
                f"step {name!r} was not started: session {run.session_id!r} of user "
                f"{run.user_id!r} was taken over while this run was paused past its lease"
            )
        run.lease_until = max(run.lease_until, asked + self.lease_seconds)

    @contextlib.contextmanager
    def subrun(self, name: str) -> Iterator[tuple[str, ...]]:
        """Key the steps made inside the block under a sub-run of the current run.

        Each use of the same ``name`` at the same level gets the next occurrence number, so two
        sequential calls to one persistent worker stay distinct and replay in order. Sub-runs
        started concurrently must use distinct names (e.g. include the tool-call slot).
        """
        frame = self._require_frame("subrun")
        _check_text("sub-run name", name)
        counter_key = (frame.path, name)
        n = frame.run.occurrences.get(counter_key, 0)
        frame.run.occurrences[counter_key] = n + 1
        path = (*frame.path, f"{name}#{n}")
        reset = _frame.set(_Frame(frame.run, path))
        try:
            yield path
        finally:
            _frame.reset(reset)

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
        if idempotency_key is not None:
            _check_text("idempotency_key", idempotency_key)
        run = frame.run
        if run.lost:
            raise OwnershipLostError(f"step {name!r}: this run lost its turn to a newer owner")
        started = time.perf_counter()
        with self._traced(run, frame.path, name, False) as note:
            if idempotency_key is not None:
                return await self._idempotent_step(
                    run, frame.path, name, fn, args, kwargs, idempotency_key, started, note
                )
            fp = self._fingerprint(name, args, kwargs)
            pkey = path_key(frame.path)
            _check_key_size(run, pkey, name)
            outcome, value = self._lookup(run, frame.path, pkey, name, fp, note)
            if outcome == "hit":
                self._emit(run, frame.path, name, False, "hit", started, 0.0, note)
                return value
            await self._check_turn(run, name)
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            write_s = await self._record(run, pkey, name, fp, "step", result)
            self._emit(run, frame.path, name, False, outcome, started, write_s, note)
            return result

    async def stream_step(
        self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """Journal a streaming call: chunks are stored once the stream ends, replayed in order.

        ``fn(*args, **kwargs)`` must give an async iterable (or a coroutine returning one). A
        stream that fails or is abandoned before its end stores nothing.
        """
        frame = self._require_frame("stream_step")
        _check_text("step name", name)
        run = frame.run
        if run.lost:
            raise OwnershipLostError(f"step {name!r}: this run lost its turn to a newer owner")
        started = time.perf_counter()
        with self._traced(run, frame.path, name, True) as note:
            fp = self._fingerprint(name, args, kwargs)
            pkey = path_key(frame.path)
            _check_key_size(run, pkey, name)
            outcome, value = self._lookup(run, frame.path, pkey, name, fp, note)
            if outcome == "hit":
                self._emit(run, frame.path, name, True, "hit", started, 0.0, note)
                for chunk in value:
                    yield chunk
                return
            await self._check_turn(run, name)
            source = fn(*args, **kwargs)
            if inspect.isawaitable(source):
                source = await source
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
            self._emit(run, frame.path, name, True, outcome, started, write_s, note)

    def _fingerprint(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        try:
            return fingerprint(args, kwargs)
        except codec.UnsupportedValueError as exc:
            raise JournalEncodeError(name, exc.type_name, "its arguments", exc.reason) from exc

    def _lookup(
        self,
        run: JournalRun,
        path: tuple[str, ...],
        pkey: str,
        name: str,
        fp: str,
        note: StepNote | None = None,
    ) -> tuple[Outcome, Any]:
        slot = run.entries.get((pkey, name))
        if not slot:
            return "miss", None
        entry = slot.get(fp)
        if entry is None:
            stored = next(iter(slot))
            run.stats.divergences += 1
            log.warning(
                "replay divergence at step %r (path %s, epoch %d): inputs changed, running fresh",
                name,
                pkey,
                run.epoch,
            )
            if run.strict:
                self._emit(run, path, name, False, "divergence", time.perf_counter(), 0.0, note)
                raise ReplayDivergenceError(name, pkey, stored, fp)
            return "divergence", None
        try:
            value = self._decode(entry)
        except _Skipped:
            return "miss", None
        except CorruptEntryError:
            run.stats.corrupt += 1
            if run.strict:
                raise
            log.warning("journal entry for step %r is corrupt; running the step again", name)
            return "corrupt", None
        run.stats.hits += 1
        run.stats.hit_steps.append(name)
        return "hit", value

    def _decode(self, entry: StoredEntry) -> Any:
        if entry.format == "pickle":
            if self.serializer != "pickle":
                _warn_pickled_once()
                raise _Skipped
            return _unpickle(entry.value)
        if entry.format != "json":
            raise CorruptEntryError(f"step {entry.name!r}: unknown value format {entry.format!r}")
        if entry.codec_version > codec.CODEC_VERSION:
            raise CorruptEntryError(
                f"step {entry.name!r}: written by a newer codec (v{entry.codec_version})"
            )
        try:
            return codec.loads(entry.value)
        except codec.UnknownTagError as exc:
            raise CorruptEntryError(f"step {entry.name!r}: {exc}") from exc

    def _encode(self, name: str, value: Any) -> tuple[str, bytes]:
        if self.serializer == "pickle":
            try:
                return "pickle", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise JournalEncodeError(name, type(value).__qualname__, "its result") from exc
        try:
            raw = codec.dumps(value)
        except codec.UnsupportedValueError as exc:
            raise JournalEncodeError(name, exc.type_name, "its result", exc.reason) from exc
        return "json", raw

    async def _record(
        self, run: JournalRun, pkey: str, name: str, fp: str, kind: str, value: Any
    ) -> float:
        fmt, raw = self._encode(name, value)
        if len(raw) > self.max_payload_bytes:
            raise PayloadTooLargeError(name, len(raw), self.max_payload_bytes)
        entry = StoredEntry(pkey, name, fp, kind, fmt, codec.CODEC_VERSION, raw, run.next_seq)
        run.next_seq += 1
        t0 = time.perf_counter()
        if not await self._store.write_entry(run.scope, run.token, run.epoch, entry):
            run.lost = True
            raise OwnershipLostError(
                f"step {name!r} ran but was not journaled: session {run.session_id!r} of user "
                f"{run.user_id!r} now belongs to a newer run"
            )
        run.entries.setdefault((pkey, name), {})[fp] = entry
        run.stats.misses += 1
        run.stats.fresh_steps.append(name)
        return time.perf_counter() - t0

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
        stored = await self._store.get_idempotent(run.scope.user_key, key)
        unreadable: StoredEntry | None = None  # replaced by the fresh result below
        if stored is not None:
            unreadable = stored
            try:
                value = self._decode(stored)
            except _Skipped:
                pass
            except CorruptEntryError:
                run.stats.corrupt += 1
                if run.strict:
                    raise
                log.warning("idempotent entry %r is corrupt; running the step again", key)
            else:
                run.stats.hits += 1
                run.stats.hit_steps.append(name)
                self._emit(run, path, name, False, "hit", started, 0.0, note)
                return value
        await self._check_turn(run, name)
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        fmt, raw = self._encode(name, result)
        if len(raw) > self.max_payload_bytes:
            raise PayloadTooLargeError(name, len(raw), self.max_payload_bytes)
        entry = StoredEntry(path_key(path), name, "", "step", fmt, codec.CODEC_VERSION, raw)
        t0 = time.perf_counter()
        winner = await self._store.put_idempotent(
            run.scope, run.token, key, entry, replacing=unreadable
        )
        write_s = time.perf_counter() - t0
        if winner is None:
            run.lost = True
            raise OwnershipLostError(f"step {name!r} ran but this run lost its turn")
        run.stats.misses += 1
        run.stats.fresh_steps.append(name)
        self._emit(run, path, name, False, "miss", started, write_s, note)
        if winner.value != raw:  # a concurrent writer recorded the key first: its result stands
            return self._decode(winner)
        return result

    def _emit(
        self,
        run: JournalRun,
        path: tuple[str, ...],
        name: str,
        stream: bool,
        outcome: Outcome,
        started: float,
        write_s: float,
        note: StepNote | None = None,
    ) -> None:
        if not self._observers and note is None:
            return
        event = StepEvent(
            backend=self.backend,
            session_id=run.session_id,
            user_id=run.user_id,
            epoch=run.epoch,
            path=path,
            name=name,
            kind=step_kind(name),
            stream=stream,
            outcome=outcome,
            duration_s=time.perf_counter() - started,
            write_s=write_s,
        )
        for observer in (note, *self._observers) if note is not None else self._observers:
            try:
                observer(event)
            except Exception:  # an observer must never break a run
                log.exception("step observer %r failed", observer)

    # -- maintenance -----------------------------------------------------------------------

    async def entries(self, session_id: str | None, user_id: str | None = None) -> list[EntryInfo]:
        """Describe every journal entry of one (session, user), oldest epoch first."""
        await self._ensure_open()
        return await self._store.list_entries(session_id, user_id)

    async def sessions(
        self, *, user_id: str | None = _ANY, session_id: str | None = None, limit: int = 100
    ) -> list[SessionInfo]:
        """The journal's (session, user) pairs, most recently active first.

        ``user_id`` filters (``None`` is the anonymous bucket; leave it out for everyone);
        ``session_id`` keeps that session's pairs only (one per user who ran it).
        """
        await self._ensure_open()
        return await self._store.list_sessions(
            None if user_id is _ANY else user_id, user_id is not _ANY, limit, session_id
        )

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
    ) -> int:
        """Delete journal entries; returns how many went (with ``dry_run``, would go).

        Filters combine: entries older than ``older_than``, of ``session_id``, of ``user_id``
        (``None`` is the anonymous bucket; leave the argument out to match every user). The
        entries of open runs (raised or crashed, still resumable) are kept unless
        ``include_open=True``. With ``older_than`` and no ``session_id``, idempotency results
        that old (of ``user_id``, if given) go too; otherwise they outlive the runs.

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
        await self._ensure_open()
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
        )


def _check_text(what: str, value: object) -> None:
    check_key(what, value, optional=False)


# scope + sub-run path + step name of one journal row, in UTF-8 bytes. With the fingerprint
# (64), the epoch and the tuple's headers the primary key entry stays under PostgreSQL's
# 2,704-byte btree limit; deep nesting under long ids is refused here, not by the driver.
MAX_JOURNAL_KEY_BYTES = 2400


def _check_key_size(run: JournalRun, pkey: str, name: str) -> None:
    size = len(run.scope.key.encode()) + len(pkey.encode()) + len(name.encode())
    if size > MAX_JOURNAL_KEY_BYTES:
        raise UserError(
            f"step {name[:60]!r}: its journal key (session id, user id, sub-run path and step "
            f"name) is {size} bytes, over the {MAX_JOURNAL_KEY_BYTES}-byte limit; use shorter "
            "ids or names, or nest fewer sub-runs"
        )


@contextlib.contextmanager
def _tracing(tracers: list[StepTracer], start: StepStart) -> Iterator[StepNote | None]:
    """Enter every tracer around one step; a failing tracer is logged, never propagated."""
    entered: list[contextlib.AbstractContextManager[StepNote | None]] = []
    notes: list[StepNote] = []
    for tracer in tracers:
        try:
            cm = tracer(start)
            note = cm.__enter__()
        except Exception:
            log.exception("step tracer %r failed on entry", tracer)
            continue
        entered.append(cm)
        if callable(note):
            notes.append(note)
    failure: BaseException | None = None
    try:
        yield (notes[0] if len(notes) == 1 else _fan_out(notes)) if notes else None
    except BaseException as exc:
        failure = exc
        raise
    finally:
        # Inner tracers leave first. Their return value is ignored: a tracer cannot swallow
        # the step's exception.
        for cm in reversed(entered):
            try:
                if failure is None:
                    cm.__exit__(None, None, None)
                else:
                    cm.__exit__(type(failure), failure, failure.__traceback__)
            except Exception:
                log.exception("step tracer %r failed on exit", cm)


def _fan_out(notes: list[StepNote]) -> StepNote:
    def note(event: StepEvent) -> None:
        for each in notes:
            try:
                each(event)
            except Exception:
                log.exception("step note %r failed", each)

    return note


class _Skipped(Exception):
    """A stored entry that this runtime is configured not to read."""


def _unpickle(raw: bytes) -> Any:
    loads = pickle.loads  # noqa: TID251 - opt-in legacy path behind serializer="pickle"
    try:
        return loads(raw)
    except Exception as exc:
        raise CorruptEntryError(f"pickled entry cannot be loaded: {exc}") from exc
