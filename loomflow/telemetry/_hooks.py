"""Spans and metrics of agent runs, plugged into the loop as :class:`RunHooks`.

The span tree of one run::

    invoke_agent {agent}                      run_started .. run_finished
    ├── loom.workflow.step  model_call_0      the runtime's step tracer
    │   └── chat {model}                      live model calls only
    ├── loom.workflow.step  tool_call_0_0_…
    │   └── execute_tool {tool}               live tool executions only
    │       └── invoke_agent {sub-agent}      an agent used as a tool nests here
    └── loom.workflow.step  model_call_1      (a replayed step: no child)

Context propagation. The agent loop is an async generator: whatever it made "current" in
``contextvars`` would stay current in the code consuming its events, and a consumer that
abandons the stream leaves the loop to be closed later, by the garbage collector, in another
context, where nothing can be undone. So the root span is never made current. Parents are
chosen explicitly: a step's parent is the current span when that span belongs to the same run
(a step or a tool execution of it: a step inside a tool nests under the tool), and otherwise
the root span of the run in ``get_run_context()``. Only spans whose start and end happen in one
coroutine are made current: a plain step's span, and the ``execute_tool`` span inside it (so
work a tool does, a sub-agent say, nests under it). A stream step yields to the consumer in
between, so it is never made current: its ``chat`` child finds it by (run id, step name).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import json
import re
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from pydantic import BaseModel

from .._cleanup import CANCELLATIONS, end_outcome
from .._printable import escaped_surrogates
from ..context import get_run_context, reset_var
from ..errors import ModelError
from ..governance.events import (
    ApprovalRequested,
    BudgetDenied,
    BudgetUnavailable,
    BudgetWarning,
    GovernanceEvent,
    GuardrailTripped,
    PermissionDecided,
)
from ..hooks import Interrupt, RunHooks, RunInfo
from ..messages import Message, ModelResponse, ModelSettings, ToolCall, Usage
from ..models._retry import error_class, observe_retries
from ..redaction import Redactor
from ..runtime._journal import StepEvent, StepNote, StepStart
from ..runtime._tracing import UNTRACED
from ..tools import UNKNOWN_TOOL, Tool, ToolOutcome
from . import _semconv as sc

__all__ = ["Counters", "TelemetryHooks", "instrument", "untraced_run"]


UserIdMode = Literal["plain", "hashed", "omit"]
# A user id this long or longer is hidden wherever it shows in error text; shorter ones only
# where quoted (see UserIds.hide).
_BARE_USER_ID_CHARS = 4
USER_ID_MODES: tuple[UserIdMode, ...] = ("plain", "hashed", "omit")


@dataclass(frozen=True)
class UserIds:
    """How spans carry a run's user id: as is, as a keyed hash, or not at all.

    ``hashed`` is HMAC-SHA-256 under a deployment secret, cut to 16 hex characters (64 bits):
    the same user hashes alike in every process that shares the key, so a trace search by the
    hash works, while without the key nobody can recover an id by hashing a list of likely
    ones (a plain or salted-in-the-open hash falls to exactly that).
    """

    mode: UserIdMode = "plain"
    key: bytes | None = None

    def attributes(self, user_id: str | None) -> dict[str, str]:
        if user_id is None or self.mode == "omit":
            return {}
        value = user_id
        if self.mode == "hashed":
            assert self.key is not None  # Telemetry checks this
            digest = hmac.new(self.key, user_id.encode("utf-8"), hashlib.sha256).hexdigest()
            value = f"h:{digest[:16]}"
        return {sc.USER_ID: value, sc.USER_ID_DOCUMENTED: value}

    def shown(self, user_id: str) -> str:
        """The user id as spans show it: as is, its hash, or ``[user]``."""
        return self.attributes(user_id).get(sc.USER_ID, "[user]")

    def hide(self, user_id: str | None) -> Callable[[str], str] | None:
        """What keeps the user id out of error text on spans (``None``: nothing to hide).

        Error text (status descriptions, ``exception`` events) is exported whatever the mode,
        and loomflow's own errors name the user (``session 's1' of user 'alice' ...``): under
        ``hashed`` and ``omit`` the id there becomes its hash, or ``[user]``. Quoted forms
        always; a bare occurrence only for ids of 4 characters or more, so that a short id does
        not turn every digit of a stack trace into a placeholder.
        """
        if user_id is None or not user_id or self.mode == "plain":
            return None
        shown = self.shown(user_id)
        quoted = {repr(user_id), f"'{user_id}'", f'"{user_id}"'}
        forms = sorted(quoted, key=len, reverse=True)
        if len(user_id) >= _BARE_USER_ID_CHARS:
            forms.append(user_id)
        # One pass: a placeholder that happens to contain the id ("[user]" for "user") is
        # not replaced again.
        pattern = re.compile("|".join(re.escape(form) for form in forms))

        def scrub(text: str) -> str:
            return pattern.sub(lambda m: repr(shown) if m.group() in quoted else shown, text)

        return scrub


class Counters(Protocol):
    """What the hooks count with: :class:`~loomflow.telemetry.Metrics` is the one kept here.

    The hooks name this rather than ``Metrics`` because ``Metrics.as_hooks()`` builds them.
    """

    def instrument(self, runtime: Any) -> None: ...

    def run_finished(
        self, *, backend: str, outcome: str, resumed: bool, duration_s: float | None = None
    ) -> None: ...

    def prepare_model(self, provider: str, model: str) -> None: ...

    def model_error(self, *, provider: str, model: str, error: str) -> None: ...

    def model_retry(self, *, provider: str, model: str, error: str) -> None: ...

    def model_call(
        self, *, provider: str, model: str, duration_s: float, error: str | None = None
    ) -> None: ...

    def model_first_chunk(self, *, provider: str, model: str, seconds: float) -> None: ...

    def tool_error(self, *, tool: str, error_type: str | None) -> None: ...

    def model_usage(
        self,
        *,
        provider: str,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cost_usd: float | None,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> None: ...

    def budget_denied(self, cap: str) -> None: ...

    def store_failed(self, exc: BaseException) -> None: ...

    def permission_decided(self, decision: str, final: str) -> None: ...

    def guardrail_tripped(self, stage: str, action: str) -> None: ...


# Retries happen inside the provider adapter, below the hooks: the retry loop reports them
# here and they are counted by the metrics of the run in progress (found by its run id).
_retry_counters: dict[str, Counters] = {}


def _count_retry(provider: str, model: str, status: int | None, exc: BaseException) -> None:
    metrics = _retry_counters.get(get_run_context().run_id or "")
    if metrics is not None:
        metrics.model_retry(provider=provider, model=model, error=error_class(status, exc))


observe_retries(_count_retry)


@dataclass(eq=False)
class _Child:
    """A ``chat`` or ``execute_tool`` span opened under a step."""

    span: Span
    token: Any = None  # the OTel context token of an attached (tool) span
    var_token: contextvars.Token[_Child | None] | None = None
    done: bool = False
    end_ns: int | None = None  # when the step around it ended (chat spans end just after)
    call: tuple[str, str] | None = None  # (run id, tool call id) of an execute_tool span

    def finish(self, end_ns: int | None = None) -> None:
        if not self.done:
            self.done = True
            self.span.end(end_time=end_ns)

    def release(self) -> None:
        """Undo what ``before_tool_call`` made current (same context: the step's coroutine)."""
        if self.token is not None:
            otel_context.detach(self.token)
            self.token = None
        if self.var_token is not None:
            reset_var(_current_tool, self.var_token)
            self.var_token = None


@dataclass(eq=False)
class _OpenStep:
    """A ``loom.workflow.step`` span between its step's start and end."""

    span: Span
    children: list[_Child] = field(default_factory=list)

    def note(self, event: StepEvent) -> None:
        self.span.set_attribute(sc.LOOM_STEP_REPLAY, event.outcome)
        if event.outcome == "divergence":
            self.span.add_event(
                "loom.replay.divergence",
                {sc.LOOM_STEP_NAME: event.name, sc.LOOM_STEP_EPOCH: event.epoch},
            )


_current_tool: contextvars.ContextVar[_Child | None] = contextvars.ContextVar(
    "loomflow_telemetry_tool", default=None
)
_current_step: contextvars.ContextVar[_OpenStep | None] = contextvars.ContextVar(
    "loomflow_telemetry_step", default=None
)
# Stream steps in progress, by (run id, step name), for their chat spans to find.
_open_streams: dict[tuple[str, str], list[_OpenStep]] = {}


@dataclass(eq=False)
class _LiveRun:
    """The root span of a run in progress and the ids of the spans that belong to it."""

    owner: Any
    span: Span
    members: set[int] = field(default_factory=set)
    children: list[_Child] = field(default_factory=list)  # chat and tool spans, to end if left
    # Usage of the model calls this invocation made, and of those it replayed from the journal.
    live_usage: Usage = field(default_factory=Usage)
    replayed_usage: Usage = field(default_factory=Usage)


@dataclass(eq=False, slots=True)
class _ModelCall:
    """The token of one live model call: when it started, and its ``chat`` span if traced."""

    started: float
    child: _Child | None = None


# Runs in progress by run id (the run ids of get_run_context()), for their steps to find.
_live: dict[str, _LiveRun] = {}


def _parent(run_id: str | None) -> tuple[otel_context.Context, _LiveRun | None]:
    """Where a span opened now belongs: see the module docstring."""
    current = otel_context.get_current()
    live = _live.get(run_id or "")
    if live is None:
        return current, None
    if trace.get_current_span(current).get_span_context().span_id in live.members:
        return current, live
    return trace.set_span_in_context(live.span, current), live


@dataclass(frozen=True, slots=True, eq=False)
class _Tracing:
    """Where a run's step spans go and how they carry its user id: one telemetry's choice."""

    tracer: Tracer | None  # None: that telemetry traces nothing (metrics only)
    user_ids: UserIds
    # A proxy of the global provider (the default telemetry's): a no-op until an SDK is set.
    proxy: bool
    # The run's redactor (the agent's), for the error text of its step spans; None outside
    # agent runs (then one built from settings).
    redactor: Redactor | None = None
    owner: Any = None  # the hooks that registered it for a run

    @classmethod
    def of(cls, tracer: Tracer | None, user_ids: UserIds | None) -> _Tracing:
        return cls(tracer, user_ids or UserIds(), isinstance(tracer, trace.ProxyTracer))


# The telemetry of each agent run in progress, by run id, set by its hooks' run_started: the
# step tracer is one per runtime, and agents sharing a runtime may each have their own
# provider and user-id mode.
_run_tracing: dict[str, _Tracing] = {}

# What a run of an agent built with telemetry=False registers: no tracer, so its steps get no
# span from the runtime's tracer (the first telemetry that instrumented the runtime).
_NO_TELEMETRY = _Tracing(None, UserIds(), False)


def untraced_run(run_id: str) -> Callable[[], None]:
    """Keep the steps of ``run_id`` out of every span; returns what ends that (at the run's
    end). An agent with ``telemetry=False`` on a runtime another agent's telemetry
    instrumented: its steps would otherwise be traced with that agent's provider and
    user-id mode."""
    _run_tracing[run_id] = _NO_TELEMETRY

    def end() -> None:
        if _run_tracing.get(run_id) is _NO_TELEMETRY:
            del _run_tracing[run_id]

    return end


# One step tracer per runtime.
_traced: weakref.WeakKeyDictionary[Any, _StepTracer] = weakref.WeakKeyDictionary()
_traced_lock = threading.Lock()


_fallback_redactor: Redactor | None = None


def _redactor(info: RunInfo | None = None) -> Redactor:
    """The run's redactor, else one built from settings (steps run outside any agent)."""
    global _fallback_redactor
    if info is not None and info.redactor is not None:
        return info.redactor
    if _fallback_redactor is None:
        _fallback_redactor = Redactor.from_settings()
    return _fallback_redactor


def _encodable(text: str) -> str:
    """``text`` as a span name or status shows it. A lone surrogate (bytes that were not UTF-8,
    read through os.environ's surrogateescape or os.listdir) has no UTF-8 form: in a span's name
    or status it failed the OTLP encoding of the whole batch, every run's spans in it; it is
    written as its escape."""
    return escaped_surrogates(text)


_MADE_UP_NAME_CHARS = 64


def _tool_name(info: RunInfo, name: str) -> str:
    """A tool call's name as spans show it: a registered tool's as is, else made up."""
    return name if name in info.tools else _made_up_name(info, name)


def _made_up_name(info: RunInfo, name: str) -> str:
    """A tool name the model made up, as spans show it: redacted, at most 64 characters."""
    shown = _redactor(info).text(name)
    if len(shown) > _MADE_UP_NAME_CHARS:
        shown = shown[: _MADE_UP_NAME_CHARS - 1] + "…"
    return shown


def _fail(
    span: Span,
    exc: BaseException,
    redactor: Redactor | None = None,
    hide: Callable[[str], str] | None = None,
) -> None:
    if isinstance(exc, CANCELLATIONS):
        span.set_attribute(sc.ERROR_TYPE, "cancelled")
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    # Exported whether or not content is captured, so the message (which may quote a tool's
    # input or a provider's reply) is redacted like an audit entry, and the user id in it
    # (loomflow's lease and busy errors name it) kept as the user_ids option says.
    redact = (redactor or _redactor()).text

    def scrub(text: str) -> str:
        text = redact(text)
        return _encodable(hide(text) if hide is not None else text)

    message = scrub(str(exc))
    span.add_event(
        "exception",
        {
            "exception.type": type(exc).__qualname__,
            "exception.message": message,
            "exception.stacktrace": scrub(
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            ),
        },
    )
    span.set_attribute(sc.ERROR_TYPE, type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {message}"[:500]))


class _StepTracer:
    """The runtime's step tracer: one ``loom.workflow.step`` span per journaled step.

    A step of an agent's run is traced by that run's telemetry (``_run_tracing``; an agent
    built with ``telemetry=False`` registers none, see :func:`untraced_run`); a step outside
    any agent's run (a runtime used directly, a workflow's own nodes) by ``fallback``, the
    first telemetry that instrumented the runtime.
    """

    def __init__(self, fallback: _Tracing) -> None:
        self.fallback = fallback

    def _resolve(self) -> tuple[str | None, _Tracing | None]:
        """The current step's run id, and what traces it; ``None`` when every span would be
        a no-op (no tracer, or the global provider's proxy with no SDK installed)."""
        run_id = get_run_context().run_id
        tracing = _run_tracing.get(run_id, self.fallback) if run_id else self.fallback
        if tracing.tracer is None or (
            # An agent's run decided this once, at its start (a run untraced then registers a
            # tracing without a tracer); checking the global provider costs an os.environ read.
            tracing.proxy and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        ):
            return run_id, None
        return run_id, tracing

    def loom_idle(self) -> bool:
        """Whether the step would get no span: the runtime then skips its tracing altogether.
        (The run's chat and tool spans, no-ops too, then find no open step, as with no
        journal.)"""
        return self._resolve()[1] is None

    def __call__(self, start: StepStart) -> contextlib.AbstractContextManager[StepNote | None]:
        run_id, tracing = self._resolve()
        if tracing is None or tracing.tracer is None:
            return _NO_SPAN
        return self._span(start, run_id, tracing.tracer, tracing)

    @contextlib.contextmanager
    def _span(
        self, start: StepStart, run_id: str | None, tracer: Tracer, tracing: _Tracing
    ) -> Iterator[StepNote]:
        attributes: dict[str, Any] = {
            sc.LOOM_STEP_NAME: start.name,
            sc.LOOM_STEP_KIND: start.kind,
            sc.LOOM_STEP_EPOCH: start.epoch,
            sc.LOOM_STEP_PATH: "/".join(start.path),
            sc.LOOM_STEP_STREAM: start.stream,
            sc.LOOM_BACKEND: start.backend,
        }
        if start.session_id is not None:
            attributes[sc.SESSION_ID] = start.session_id
            attributes[sc.GEN_AI_CONVERSATION_ID] = start.session_id
        user_ids = tracing.user_ids
        attributes.update(user_ids.attributes(start.user_id))
        if run_id:
            attributes[sc.LOOM_RUN_ID] = run_id
        parent, live = _parent(run_id)
        span = tracer.start_span(
            sc.STEP_SPAN, context=parent, kind=SpanKind.INTERNAL, attributes=attributes
        )
        if live is not None:
            live.members.add(span.get_span_context().span_id)
        step = _OpenStep(span)
        key = (run_id or "", start.name)
        token = var_token = None
        if start.stream:
            _open_streams.setdefault(key, []).append(step)
        else:
            token = otel_context.attach(trace.set_span_in_context(span))
            var_token = _current_step.set(step)
        failure: BaseException | None = None
        try:
            yield step.note
        except BaseException as exc:
            failure = exc
            _fail(span, exc, tracing.redactor, user_ids.hide(start.user_id))
            raise
        finally:
            ended = time.time_ns()
            for child in step.children:
                if child.done:
                    continue
                if failure is not None or child.token is not None:
                    # A tool span the hooks never closed (a hook interrupted, the tool raised)
                    # or a chat span of a failed stream.
                    if failure is not None:
                        _fail(child.span, failure, tracing.redactor, user_ids.hide(start.user_id))
                    child.release()
                    child.finish(ended)
                else:
                    child.end_ns = ended  # after_model_call ends it with its response
            if var_token is not None:
                reset_var(_current_step, var_token)
            if token is not None:
                otel_context.detach(token)
            if start.stream:
                waiting = _open_streams.get(key, [])
                if step in waiting:
                    waiting.remove(step)
                if not waiting:
                    _open_streams.pop(key, None)
            span.end(end_time=ended)


_NO_SPAN = UNTRACED  # the runtime skips a step its tracer returns this for


def instrument(
    runtime: Any,
    tracer: Tracer | None,
    metrics: Counters | None,
    user_ids: UserIds | None = None,
) -> None:
    """Trace (with ``tracer``) and count (with ``metrics``) every journaled step of ``runtime``.

    Idempotent. The steps of an agent's run are traced by that agent's telemetry (its tracer
    and ``user_ids``), whichever telemetry instrumented the runtime; steps made outside any
    agent's run, by the first tracer that instrumented it. A runtime without a journal (an
    agent with ``runtime=None``) has no steps and is left alone.
    """
    if tracer is not None and hasattr(runtime, "add_step_tracer"):
        tracing = _Tracing.of(tracer, user_ids)
        with _traced_lock:
            fresh = runtime not in _traced
            if fresh:
                _traced[runtime] = _StepTracer(tracing)
        if fresh:
            runtime.add_step_tracer(_traced[runtime])
    if metrics is not None:
        metrics.instrument(runtime)


class TelemetryHooks(RunHooks):
    """Spans and metrics of every run, as the agent loop's hooks (``Telemetry.as_hooks()``)."""

    def __init__(
        self,
        tracer: Tracer | None,
        metrics: Counters | None,
        *,
        content: bool,
        user_ids: UserIds | None = None,
    ) -> None:
        self.tracer = tracer
        self.metrics = metrics
        self.content = content
        self.user_ids = user_ids or UserIds()
        self._tracing = _Tracing.of(tracer, self.user_ids)
        # What a run that starts without spans registers for its steps: none either, for the
        # whole run, as its own spans (see _traces).
        self._untraced = _Tracing(None, self.user_ids, False)
        self._started: dict[str, float] = {}  # run id -> monotonic start, for run duration

    @staticmethod
    def _scrub(info: RunInfo, value: Any) -> str:
        """Captured content as span text, redacted as the audit log redacts it: secret values
        and shapes in every string, and values under sensitive key names (``password``...)."""
        redactor = _redactor(info)
        if isinstance(value, str):
            return redactor.text(value)
        return _json(redactor.value(value))

    def _run(self, info: RunInfo) -> _LiveRun | None:
        """The run's spans, if it has any (see :meth:`_traces`)."""
        live = _live.get(info.run_id)
        return live if live is not None and live.owner is self else None

    def _traces(self) -> bool:
        """Whether a run starting now gets spans: not without a tracer, nor while the tracer
        is the global API's and no SDK is installed (every span would be a no-op; building
        them cost about 20 us per turn). A run keeps the answer it started with."""
        unset = isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        return self.tracer is not None and not (self._tracing.proxy and unset)

    # -- runs ------------------------------------------------------------------------------

    async def run_started(self, info: RunInfo) -> None:
        # The run's journal (the enclosing run's for a sub-agent); instrumenting is idempotent.
        runtime = info.runtime
        # Registered before instrumenting, and even without a tracer: this run's steps follow
        # this telemetry, not the runtime's first (a metrics-only or "omit" agent's steps must
        # not be traced with another agent's tracer or user-id mode).
        traces = self._traces()
        # With the run's redactor: its step spans' error text is scrubbed as its root's is.
        _run_tracing[info.run_id] = replace(
            self._tracing if traces else self._untraced, redactor=info.redactor, owner=self
        )
        if runtime is not None:
            instrument(runtime, self.tracer, self.metrics, self.user_ids)
        if self.metrics is not None:
            self._started[info.run_id] = time.monotonic()
            _retry_counters[info.run_id] = self.metrics
            self.metrics.prepare_model(info.provider, info.model_name)
        if self.tracer is None or not traces:
            return
        attributes: dict[str, Any] = {
            sc.GEN_AI_OPERATION_NAME: "invoke_agent",
            sc.GEN_AI_AGENT_NAME: info.agent_name,
            sc.GEN_AI_PROVIDER_NAME: info.provider,
            sc.GEN_AI_REQUEST_MODEL: _encodable(info.model_name),
            sc.GEN_AI_CONVERSATION_ID: info.session_id,
            sc.SESSION_ID: info.session_id,
            sc.LOOM_RUN_ID: info.run_id,
            sc.LOOM_RUN_RESUMED: info.resumed,
            sc.LOOM_BACKEND: info.backend,
        }
        attributes.update(self.user_ids.attributes(info.user_id))
        if info.epoch is not None:
            attributes[sc.LOOM_RUN_EPOCH] = info.epoch
        # The parent is the current span: the caller's, or the execute_tool span of the tool
        # this agent serves as.
        span = self.tracer.start_span(
            f"invoke_agent {info.agent_name}", kind=SpanKind.INTERNAL, attributes=attributes
        )
        _live[info.run_id] = _LiveRun(self, span)

    async def check_input(self, info: RunInfo, prompt: str) -> str:
        # Recorded here, after the guardrails (earlier hooks) had their say on the prompt.
        live = self._run(info)
        if live is not None and self.content:
            live.span.set_attribute(
                sc.GEN_AI_INPUT_MESSAGES,
                self._scrub(
                    info, [{"role": "user", "parts": [{"type": "text", "content": prompt}]}]
                ),
            )
        return prompt

    async def run_finished(
        self, info: RunInfo, result: Any | None, error: BaseException | None
    ) -> None:
        if error is not None:
            outcome = end_outcome(error)
        elif result is not None and result.interrupted:
            outcome = "interrupted"
        else:
            outcome = "finished"
        registered = _run_tracing.get(info.run_id)
        if registered is not None and registered.owner is self:
            del _run_tracing[info.run_id]
        if self.metrics is not None:
            started = self._started.pop(info.run_id, None)
            _retry_counters.pop(info.run_id, None)
            self.metrics.run_finished(
                backend=info.backend,
                outcome=outcome,
                resumed=info.resumed,
                duration_s=None if started is None else time.monotonic() - started,
            )
            if error is not None:
                self.metrics.store_failed(error)
        live = self._run(info)
        if live is None:
            return
        del _live[info.run_id]
        span = live.span
        for child in live.children:
            if not child.done:  # a chat span whose after_model_call never came, say
                if error is not None:
                    _fail(child.span, error, _redactor(info), self.user_ids.hide(info.user_id))
                child.finish(child.end_ns)
        span.set_attribute(sc.LOOM_RUN_OUTCOME, outcome)
        # Live calls under the GenAI names (what was billed now, as metrics and the audit log
        # count it, also by a run that then failed); calls replayed from the journal under
        # loom.usage.replayed.*.
        _set_usage(span, live.live_usage)
        replayed = live.replayed_usage
        span.set_attribute(sc.LOOM_USAGE_REPLAYED_INPUT_TOKENS, replayed.input_tokens)
        span.set_attribute(sc.LOOM_USAGE_REPLAYED_OUTPUT_TOKENS, replayed.output_tokens)
        if replayed.cache_read_tokens:
            span.set_attribute(
                sc.LOOM_USAGE_REPLAYED_CACHE_READ_INPUT_TOKENS, replayed.cache_read_tokens
            )
        if replayed.cache_write_tokens:
            span.set_attribute(
                sc.LOOM_USAGE_REPLAYED_CACHE_CREATION_INPUT_TOKENS, replayed.cache_write_tokens
            )
        if result is not None:
            span.set_attribute(sc.LOOM_RUN_TURNS, result.turns)
            span.set_attribute(sc.LOOM_RUN_COST_USD, result.cost_usd)
            span.set_attribute(sc.LOOM_RUN_REPLAYED_STEPS, result.replayed_steps)
            span.set_attribute(sc.LOOM_RUN_FRESH_STEPS, result.fresh_steps)
            if result.interruption_reason:
                span.set_attribute(sc.LOOM_RUN_INTERRUPTION_REASON, result.interruption_reason)
            if self.content:
                span.set_attribute(
                    sc.GEN_AI_OUTPUT_MESSAGES,
                    self._scrub(
                        info,
                        [
                            {
                                "role": "assistant",
                                "parts": [{"type": "text", "content": result.output}],
                            }
                        ],
                    ),
                )
        if error is not None:
            _fail(span, error, _redactor(info), self.user_ids.hide(info.user_id))
        span.end()

    # -- model calls -----------------------------------------------------------------------

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        call = _ModelCall(time.perf_counter())
        if self._run(info) is not None:
            call.child = self._chat_span(info, turn, messages, settings)
        return call

    def _chat_span(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> _Child:
        assert self.tracer is not None
        waiting = _open_streams.get((info.run_id, f"model_call_{turn}"))
        step = waiting[-1] if waiting else None
        live = self._run(info)
        if step is not None:
            parent: otel_context.Context | None = trace.set_span_in_context(step.span)
        elif live is not None:  # no journal: no step span
            parent = trace.set_span_in_context(live.span)
        else:
            parent = None
        attributes: dict[str, Any] = {
            sc.GEN_AI_OPERATION_NAME: "chat",
            sc.GEN_AI_PROVIDER_NAME: info.provider,
            sc.GEN_AI_REQUEST_MODEL: _encodable(info.model_name),
            sc.GEN_AI_REQUEST_MAX_TOKENS: settings.max_tokens,
            sc.GEN_AI_CONVERSATION_ID: info.session_id,
        }
        if settings.temperature is not None:
            attributes[sc.GEN_AI_REQUEST_TEMPERATURE] = settings.temperature
        if self.content:
            system = [m for m in messages if m.role == "system"]
            if system:
                attributes[sc.GEN_AI_SYSTEM_INSTRUCTIONS] = self._scrub(
                    info, [{"type": "text", "content": m.content} for m in system]
                )
            attributes[sc.GEN_AI_INPUT_MESSAGES] = self._scrub(
                info, [_message_json(m) for m in messages if m.role != "system"]
            )
        span = self.tracer.start_span(
            f"chat {_encodable(info.model_name)}",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )
        child = _Child(span)
        if step is not None:
            step.children.append(child)
        if live is not None:
            live.children.append(child)
        return child

    async def model_first_chunk(self, info: RunInfo, turn: int, *, token: Any) -> None:
        if self.metrics is not None and isinstance(token, _ModelCall):
            self.metrics.model_first_chunk(
                provider=info.provider,
                model=info.model_name,
                seconds=time.perf_counter() - token.started,
            )

    async def model_call_finished(
        self, info: RunInfo, turn: int, response: ModelResponse, *, token: Any
    ) -> None:
        # The whole response is in, the journal write is still to come: the call's duration
        # ends here.
        if self.metrics is not None and isinstance(token, _ModelCall):
            self.metrics.model_call(
                provider=info.provider,
                model=info.model_name,
                duration_s=time.perf_counter() - token.started,
            )

    async def model_call_failed(
        self, info: RunInfo, turn: int, error: BaseException, token: Any
    ) -> None:
        call = token if isinstance(token, _ModelCall) else None
        # A refusal by a hook (a budget) is no provider call; a caller going away is not a
        # provider error, but the call it abandoned did take time.
        if self.metrics is not None and call is not None and not isinstance(error, Interrupt):
            if isinstance(error, CANCELLATIONS):
                kind = "cancelled"
            else:
                kind = error_class(error.status if isinstance(error, ModelError) else None, error)
                self.metrics.model_error(provider=info.provider, model=info.model_name, error=kind)
            self.metrics.model_call(
                provider=info.provider,
                model=info.model_name,
                duration_s=time.perf_counter() - call.started,
                error=kind,
            )
        child = call.child if call is not None else None
        if child is not None and not child.done:
            _fail(child.span, error, _redactor(info), self.user_ids.hide(info.user_id))
            child.finish()

    async def after_model_call(
        self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
    ) -> None:
        usage = response.usage
        live = self._run(info)
        if replayed:  # nothing was called, billed or waited for
            if live is not None:
                live.replayed_usage = live.replayed_usage + usage
            return
        if live is not None:
            live.live_usage = live.live_usage + usage
        call = token if isinstance(token, _ModelCall) else None
        # A call whose provider sent no token counts has no figures: 0 would read as a call
        # that used nothing (a point of the token histogram, a span saying so).
        if self.metrics is not None and response.usage_reported:
            self.metrics.model_usage(
                provider=info.provider,
                model=info.model_name,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cost_usd=info.cost_usd(response),
                cache_read_tokens=usage.cache_read_tokens,
                cache_write_tokens=usage.cache_write_tokens,
            )
        child = call.child if call is not None else None
        if child is None or child.done:
            return
        span = child.span
        span.set_attribute(sc.GEN_AI_RESPONSE_MODEL, _encodable(response.model or info.model_name))
        if response.usage_reported:
            _set_usage(span, usage)
        span.set_attribute(sc.GEN_AI_RESPONSE_FINISH_REASONS, [response.finish_reason])
        if self.content:
            output = _message_json(response.to_message())
            output["finish_reason"] = response.finish_reason
            span.set_attribute(sc.GEN_AI_OUTPUT_MESSAGES, self._scrub(info, [output]))
        child.finish(child.end_ns)

    # -- tool calls ------------------------------------------------------------------------

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        if self.tracer is None or self._run(info) is None:
            return call
        # A registered tool's name is the application's; any other name is the model's output
        # (unbounded, and it may echo a secret it read): redacted and cut, as error text is.
        name = call.name if tool is not None else _made_up_name(info, call.name)
        attributes: dict[str, Any] = {
            sc.GEN_AI_OPERATION_NAME: "execute_tool",
            sc.GEN_AI_TOOL_NAME: name,
            sc.GEN_AI_TOOL_CALL_ID: call.id,
            sc.GEN_AI_TOOL_TYPE: "function",
            sc.GEN_AI_CONVERSATION_ID: info.session_id,
        }
        if tool is not None and tool.description:
            attributes[sc.GEN_AI_TOOL_DESCRIPTION] = tool.description
        if self.content:
            attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS] = self._scrub(info, call.arguments)
        # The parent is the tool's step span, current in this coroutine (or, with no journal,
        # the run's root span).
        parent, live = _parent(info.run_id)
        # The span name is what backends group by (operations, span metrics): a made-up
        # name is "unknown" there, as on the metrics, so the model cannot multiply them.
        span = self.tracer.start_span(
            f"execute_tool {name if tool is not None else 'unknown'}",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
        )
        child = _Child(span, call=(info.run_id, call.id))
        # Current while the tool runs, so what the tool does (a sub-agent) nests under it.
        # Undone in check_tool_result, or by the step's tracer if that never comes; both run
        # in the step's coroutine, the context this is set in.
        child.token = otel_context.attach(trace.set_span_in_context(span))
        child.var_token = _current_tool.set(child)
        step = _current_step.get()
        if step is not None:
            step.children.append(child)
        if live is not None:
            live.members.add(span.get_span_context().span_id)
            live.children.append(child)
        return call

    async def check_tool_result(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, outcome: ToolOutcome
    ) -> ToolOutcome:
        child = _current_tool.get()
        # A call refused before it started has no span of its own: the one current here may
        # be the enclosing run's (this run is an agent used as a tool), not ours to end.
        if child is None or child.done or child.call != (info.run_id, call.id):
            return outcome
        span = child.span
        if not outcome.ok:
            span.set_attribute(sc.ERROR_TYPE, outcome.error_type or "tool_error")
            error = _redactor(info).text(outcome.error or "")
            hide = self.user_ids.hide(info.user_id)
            if hide is not None:
                error = hide(error)
            span.set_status(Status(StatusCode.ERROR, _encodable(error)[:500]))
        elif self.content:
            found = info.tools.get(call.name)
            if found is not None and found.sensitive_result:
                # Sealed everywhere else; the span must not be the one place it shows.
                span.set_attribute(sc.GEN_AI_TOOL_CALL_RESULT, "[sealed-result]")
            else:
                span.set_attribute(sc.GEN_AI_TOOL_CALL_RESULT, self._scrub(info, outcome.as_text()))
        child.release()
        child.finish()
        return outcome

    async def tool_finished(
        self,
        info: RunInfo,
        turn: int,
        slot: int,
        call: ToolCall,
        outcome: ToolOutcome,
        *,
        step: str,
        executed: bool,
    ) -> None:
        # Refusals (a permission denial) are counted by their own metric, not as tool errors;
        # a name the model made up (nothing executed) is one, labelled "unknown".
        made_up = outcome.error_type == UNKNOWN_TOOL and call.name not in info.tools
        if self.metrics is not None and (executed or made_up) and not outcome.ok:
            name = call.name if call.name in info.tools else "unknown"
            self.metrics.tool_error(tool=name, error_type=outcome.error_type)

    # -- governance ------------------------------------------------------------------------

    async def on_event(self, info: RunInfo, event: BaseModel) -> None:
        if isinstance(event, GovernanceEvent):
            live = self._run(info)
            span = live.span if live is not None else None
            event.accept(_GovernanceSignals(self.metrics, span, info, self.user_ids))


@dataclass(slots=True)
class _GovernanceSignals:
    """A governance event as metrics and as an event on the run's span (a GovernanceVisitor)."""

    metrics: Counters | None
    span: Span | None
    info: RunInfo
    user_ids: UserIds

    def _policy(self, policy: str) -> str:
        """A permission policy's name; a user's own (``user:<id>``) names the user as the
        spans' ``user_ids`` option says."""
        user_id = self.info.user_id
        if user_id is not None and policy == f"user:{user_id}":
            return f"user:{self.user_ids.shown(user_id)}"
        return policy

    def _reason(self, reason: str) -> str:
        # Exported with content capture off, like error text, and scrubbed as it is: a failed
        # check's reason quotes its exception, an approver's is free text.
        reason = _redactor(self.info).text(reason)
        hide = self.user_ids.hide(self.info.user_id)
        return reason if hide is None else hide(reason)

    def budget_denied(self, event: BudgetDenied) -> None:
        if self.metrics is not None:
            self.metrics.budget_denied(event.cap)
        if self.span is not None:
            self.span.add_event(
                "loom.budget.denied",
                {
                    "loom.budget.cap": event.cap,
                    "loom.budget.limit": event.limit,
                    "loom.budget.used": event.used,
                    "loom.budget.requested": event.requested,
                },
            )

    def budget_unavailable(self, event: BudgetUnavailable) -> None:
        # The store failed and the budget refused the call (fail closed).
        if self.metrics is not None:
            self.metrics.budget_denied("unavailable")
        if self.span is not None:
            self.span.add_event("loom.budget.unavailable")

    def budget_warning(self, event: BudgetWarning) -> None:
        if self.span is not None:
            self.span.add_event(
                "loom.budget.warning",
                {"loom.budget.cap": event.cap, "loom.budget.fraction": event.fraction},
            )

    def permission_decided(self, event: PermissionDecided) -> None:
        if self.metrics is not None:
            self.metrics.permission_decided(event.decision, event.final)
        if self.span is not None:
            self.span.add_event(
                "loom.permission.decided",
                {
                    sc.GEN_AI_TOOL_NAME: _tool_name(self.info, event.tool),
                    "loom.permission.decision": event.decision,
                    "loom.permission.final": event.final,
                    "loom.permission.policy": self._policy(event.policy),
                    "loom.permission.reason": self._reason(event.reason),
                },
            )

    def approval_requested(self, event: ApprovalRequested) -> None:
        if self.span is not None:
            self.span.add_event(
                "loom.approval.requested",
                {
                    sc.GEN_AI_TOOL_NAME: _tool_name(self.info, event.tool),
                    "loom.approval.request_id": event.request_id,
                    "loom.permission.policy": self._policy(event.policy),
                },
            )

    def guardrail_tripped(self, event: GuardrailTripped) -> None:
        if self.metrics is not None:
            self.metrics.guardrail_tripped(event.stage, event.action)
        if self.span is not None:
            self.span.add_event(
                "loom.guardrail.tripped",
                {
                    "loom.guardrail.name": event.name,
                    "loom.guardrail.stage": event.stage,
                    "loom.guardrail.action": event.action,
                },
            )


def _set_usage(span: Span, usage: Usage) -> None:
    """Token counts under the GenAI names; the cache figures only when there are any."""
    span.set_attribute(sc.GEN_AI_USAGE_INPUT_TOKENS, usage.input_tokens)
    span.set_attribute(sc.GEN_AI_USAGE_OUTPUT_TOKENS, usage.output_tokens)
    if usage.cache_read_tokens:
        span.set_attribute(sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, usage.cache_read_tokens)
    if usage.cache_write_tokens:
        span.set_attribute(sc.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, usage.cache_write_tokens)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str, separators=(",", ":"))


def _message_json(message: Message) -> dict[str, Any]:
    """A message in the GenAI conventions' shape: a role and a list of typed parts."""
    parts: list[dict[str, Any]] = []
    if message.role == "tool":
        parts.append(
            {"type": "tool_call_response", "id": message.tool_call_id, "response": message.content}
        )
    else:
        if message.content:
            parts.append({"type": "text", "content": message.content})
        parts.extend(
            {"type": "tool_call", "id": c.id, "name": c.name, "arguments": c.arguments}
            for c in message.tool_calls
        )
    return {"role": message.role, "parts": parts}
