"""What the journal tells observers and tracers about each step.

The runtime imports no telemetry: telemetry and audit register a :data:`StepTracer` (wrapped
around each step) or an observer (told what happened afterwards) with the runtime, and
:class:`StepSignals` hands them :class:`StepStart` and :class:`StepEvent` values. A tracer or
observer that fails is logged and ignored: it never breaks a run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

__all__ = [
    "UNTRACED",
    "Outcome",
    "StepEvent",
    "StepNote",
    "StepSignals",
    "StepStart",
    "StepTracer",
    "step_kind",
]

log = logging.getLogger("loomflow.runtime")

Outcome = Literal["hit", "miss", "divergence", "corrupt"]


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

A tracer that is often idle (loomflow's own, while no OpenTelemetry SDK is installed) may also
have a ``loom_idle()`` method: when it is the runtime's only tracer, a step asks it first and,
on ``True``, is not traced at all, which spares the step building a :class:`StepStart`.
"""

# Shared by every untraced step (nullcontext is reusable): no allocation on the hot path. A
# tracer returns it to say it has nothing to trace for a step (no SDK installed, say).
UNTRACED: contextlib.AbstractContextManager[StepNote | None] = contextlib.nullcontext()


class _Run(Protocol):
    """The parts of a journal run a step's signals name."""

    @property
    def session_id(self) -> str | None: ...

    @property
    def user_id(self) -> str | None: ...

    @property
    def epoch(self) -> int: ...


class _Backend(Protocol):
    @property
    def backend(self) -> str: ...


class StepSignals:
    """The tracers and observers of one runtime, and the two calls every step makes."""

    __slots__ = ("observers", "store", "tracers")

    def __init__(self, store: _Backend) -> None:
        self.store = store  # its backend label is read per step: a store may resolve it late
        self.observers: list[StepNote] = []
        self.tracers: list[StepTracer] = []

    def traced(
        self, run: _Run, path: tuple[str, ...], name: str, stream: bool
    ) -> contextlib.AbstractContextManager[StepNote | None]:
        """The block one step runs in: every tracer entered, or a shared no-op."""
        tracers = self.tracers
        if not tracers:
            return UNTRACED
        if len(tracers) == 1:
            # A tracer that can tell it has nothing to trace now (loomflow's telemetry with no
            # OpenTelemetry SDK installed) says so before the step builds a StepStart for it.
            idle = getattr(tracers[0], "loom_idle", None)
            try:
                if idle is not None and idle():
                    return UNTRACED
            except Exception:
                log.exception("step tracer %r failed on entry", tracers[0])
                return UNTRACED
        start = StepStart(
            backend=self.store.backend,
            session_id=run.session_id,
            user_id=run.user_id,
            epoch=run.epoch,
            path=path,
            name=name,
            kind=step_kind(name),
            stream=stream,
        )
        if len(tracers) == 1:
            # The usual case (the default telemetry), without the generator of _tracing: with
            # no OpenTelemetry SDK installed this is the whole cost a step pays for spans.
            try:
                cm = tracers[0](start)
            except Exception:
                log.exception("step tracer %r failed on entry", tracers[0])
                return UNTRACED
            return UNTRACED if cm is UNTRACED else _Guarded(cm)
        return _tracing(tracers, start)

    def emit(
        self,
        run: _Run,
        path: tuple[str, ...],
        name: str,
        stream: bool,
        outcome: Outcome,
        started: float,
        write_s: float,
        note: StepNote | None = None,
    ) -> None:
        """Tell the step's tracer note, then every observer, what happened (never raises)."""
        if not self.observers and note is None:
            return
        event = StepEvent(
            backend=self.store.backend,
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
        for observer in (note, *self.observers) if note is not None else self.observers:
            try:
                observer(event)
            except Exception:  # an observer must never break a run
                log.exception("step observer %r failed", observer)


class _Guarded:
    """One tracer's block, whose failures are logged, never propagated (as in _tracing)."""

    __slots__ = ("cm", "entered")

    def __init__(self, cm: contextlib.AbstractContextManager[StepNote | None]) -> None:
        self.cm = cm
        self.entered = False

    def __enter__(self) -> StepNote | None:
        try:
            note = self.cm.__enter__()
        except Exception:
            log.exception("step tracer block %r failed on entry", self.cm)
            return None
        self.entered = True
        return note if callable(note) else None

    def __exit__(self, *exc_info: Any) -> None:
        if not self.entered:
            return
        try:
            self.cm.__exit__(*exc_info)  # its return value is ignored: it cannot swallow
        except Exception:
            log.exception("step tracer block %r failed on exit", self.cm)


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
