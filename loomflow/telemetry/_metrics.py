"""Prometheus metrics of journaled runs, with labels that stay bounded by construction.

No metric here has a label for a user, a session or a run: those are unbounded and belong on
spans and in the audit log. Every label takes its values from a small fixed set (backends, step
kinds, replay outcomes, run outcomes) or from deployment configuration (model names, budget
caps, audit actions), and the latter go through :class:`_Bounded`, which folds anything past a
fixed number of distinct values into ``"other"`` so that a bug elsewhere cannot explode the
series count.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, get_args

from opentelemetry.metrics import MeterProvider
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import make_wsgi_app, start_http_server

from .._printable import escaped_surrogates
from ..audit.actions import ALL as AUDIT_ACTIONS
from ..audit.actions import KEPT_BY_ERASURE
from ..errors import ConfigurationError, InvalidArgumentError, StoreUnavailableError
from ..governance.guardrails import Action as GuardrailAction
from ..models._retry import ERROR_CLASSES, error_class
from ..runtime import RUN_STATES
from ..runtime._journal import StepEvent
from ..runtime._states import UNREADABLE
from . import _semconv as sc
from ._hooks import TelemetryHooks
from ._instruments import Instruments, InstrumentSpec, instruments_for

__all__ = [
    "BUDGET_CAPS",
    "ERROR_CLASSES",
    "GEN_AI_DURATION_BUCKETS",
    "GEN_AI_TOKEN_BUCKETS",
    "JOURNAL_WRITE_BUCKETS",
    "KINDS",
    "MAX_LABEL_VALUES",
    "Metrics",
    "MetricsServer",
    "OTEL_INSTRUMENTS",
    "OUTCOMES",
    "RECOVERY_BUCKETS",
    "RECOVERY_OUTCOMES",
    "RUN_BUCKETS",
    "RUN_OUTCOMES",
    "STEP_BUCKETS",
    "STORES",
    "TOOL_ERROR_TYPES",
    "error_class",
    "serve_metrics",
]

KINDS: Final = ("model", "tool", "memory", "custom")
"""Step kinds, as the runtime classifies step names."""
OUTCOMES: Final = ("hit", "miss", "divergence", "corrupt")
"""What the journal did at a step: replayed it, ran it fresh, ran it fresh although the journal
held other inputs at that position, or ran it fresh because the stored entry was unreadable."""
RUN_OUTCOMES: Final = ("finished", "interrupted", "failed", "cancelled", "claim_lost")
"""How a run ended: returned an answer, returned interrupted (max_turns, budget, guardrail),
raised (stays open, resumable), was cancelled / abandoned by its caller (also resumable), or
was taken over by another owner (``OwnershipLostError``: the new owner decides how it ends)."""
RECOVERY_OUTCOMES: Final = (
    "resumed", "finished", "interrupted", "retry_failed", "dead_lettered", "unregistered",
    "claim_lost", "cancelled", "store_unavailable",
)  # fmt: skip
"""What a recoverer did with an orphaned run: claimed and resumed it; the resumed run finished;
the resumed run stopped again (for an approval, at a budget cap or ``max_turns``); the resumed
run raised (retried later); gave up on it (``failed``); left it alone (no agent registered
under its name, a changed configuration, or steps a newer loomflow journaled); lost the claim
to another recoverer; found it cancelled while resuming it; or one of loomflow's own stores
failed during the attempt (``StoreUnavailableError``: an outage, given back, not a failure of
the run; ``loomflow_store_unavailable_total`` says which store)."""
# From a lease running out to a recoverer resuming the run: a lease (30 s by default) plus a
# sweep interval is the expected range, minutes mean no worker is sweeping.
RECOVERY_BUCKETS: Final = (
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip
STORES: Final = ("journal", "budget", "audit")
"""Stores whose failures are counted by ``loomflow_store_unavailable_total``."""

# -- provider errors, retries, tool errors and run duration (one block) ----------------------
TOOL_ERROR_TYPES: Final = (
    "tool_error", "invalid_arguments", "timeout", "unknown_tool", "sealed_arguments_lost",
    "other",
)  # fmt: skip
"""The ``error_type`` label of tool errors (``ToolOutcome.error_type``, anything else ``other``)."""
# Runs range from one replayed step (milliseconds) to long tool loops (many minutes).
RUN_BUCKETS: Final = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip


def _cap_names() -> tuple[str, ...]:
    # Every name a governance Cap can have: <scope>.<metric>[.daily|.monthly]; run caps have
    # no window. tests/telemetry checks this against Cap itself.
    metrics = ("tokens_in", "tokens_out", "tokens_total", "cost_usd", "wall_clock_s")
    names = [f"run.{m}" for m in metrics]
    for scope in ("user", "global"):
        for m in metrics:
            names += [f"{scope}.{m}", f"{scope}.{m}.daily", f"{scope}.{m}.monthly"]
    return (*names, "unavailable")


BUDGET_CAPS: Final = _cap_names()
"""Every ``cap`` label a budget denial can carry (35 cap names, and ``unavailable`` when the
budget store failed). Their series exist at 0 from registration, so that a cap's first burst
of denials is an increase that rules can see, not the birth of a series."""

# Steps range from replayed entries (tens of microseconds) to model calls (tens of seconds).
STEP_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0,
)  # fmt: skip
# One fenced INSERT: ~0.1 ms in memory, ~1-5 ms on SQLite with synchronous=FULL (an fsync), a
# network round trip plus a commit on PostgreSQL. The alert on p99 sits at 250 ms.
JOURNAL_WRITE_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

# The bucket boundaries the GenAI conventions advise for gen_ai.client.token.usage and for
# gen_ai.client.operation.duration (also used for the time to first chunk).
GEN_AI_TOKEN_BUCKETS: Final = (
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
    4194304.0, 16777216.0, 67108864.0,
)  # fmt: skip
GEN_AI_DURATION_BUCKETS: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip

_S = InstrumentSpec
OTEL_INSTRUMENTS: Final[dict[str, InstrumentSpec]] = {
    # GenAI client metrics (semantic conventions), live model calls only.
    "token_usage": _S(
        "gen_ai.client.token.usage", "histogram", "{token}",
        "Tokens of one live model call, by gen_ai.token.type (input, output).",
        GEN_AI_TOKEN_BUCKETS,
    ),
    "operation_duration": _S(
        "gen_ai.client.operation.duration", "histogram", "s",
        "Wall time of one live model call, with error.type when it failed.",
        GEN_AI_DURATION_BUCKETS,
    ),
    "time_to_first_chunk": _S(
        "gen_ai.client.operation.time_to_first_chunk", "histogram", "s",
        "Time from a streamed model call's request to its first streamed chunk.",
        GEN_AI_DURATION_BUCKETS,
    ),
    # loomflow's own, mirroring the Prometheus families (same attributes as their labels).
    "steps": _S("loomflow.journal.steps", "counter", "{step}",
                "Journaled steps by replay outcome (hit, miss, divergence, corrupt)."),
    "step_seconds": _S("loomflow.step.duration", "histogram", "s",
                       "Wall time of a journaled step.", STEP_BUCKETS),
    "write_seconds": _S("loomflow.journal.write", "histogram", "s",
                        "Time to write (and commit) one journal entry.", JOURNAL_WRITE_BUCKETS),
    "runs": _S("loomflow.runs", "counter", "{run}",
               "Agent runs by how they ended and whether they resumed a journaled run."),
    "run_seconds": _S("loomflow.run.duration", "histogram", "s",
                      "Wall time of an agent run, by how it ended.", RUN_BUCKETS),
    "runs_by_state": _S("loomflow.runs.by_state", "gauge", "{run}",
                        "Runs of a journal in each run state."),
    "cost": _S("loomflow.model.cost.usd", "counter", "{USD}",
               "Estimated USD cost of live model calls."),
    "cache_tokens": _S("loomflow.model.cache_tokens", "counter", "{token}",
                       "Input tokens of live model calls read from or written to a prompt cache."),
    "budget_denials": _S("loomflow.budget.denials", "counter", "{call}",
                         "Model calls refused by the budget, by cap."),
    "permission_decisions": _S("loomflow.permission.decisions", "counter", "{decision}",
                               "Permission decisions on live tool calls."),
    "guardrail_trips": _S("loomflow.guardrail.trips", "counter", "{trip}",
                          "Guardrails that blocked or redacted something."),
    "audit_entries": _S("loomflow.audit.entries", "counter", "{entry}",
                        "Entries appended to the audit log, by action."),
    "store_unavailable": _S("loomflow.store.unavailable", "counter", "{operation}",
                            "Operations refused because a store failed underneath."),
    "model_errors": _S("loomflow.model.errors", "counter", "{call}",
                       "Live model calls that failed, by error class."),
    "model_retries": _S("loomflow.model.retries", "counter", "{request}",
                        "Provider requests attempted again after a transient failure."),
    "tool_errors": _S("loomflow.tool.errors", "counter", "{call}",
                      "Executed tool calls that returned an error."),
    "recoveries": _S("loomflow.recoveries", "counter", "{run}",
                     "What recoverers did with orphaned runs, by outcome."),
    "recovery_delay": _S("loomflow.recovery.delay", "histogram", "s",
                         "Time from a run being orphaned to a recoverer resuming it.",
                         RECOVERY_BUCKETS),
}  # fmt: skip
"""The OpenTelemetry instruments :class:`Metrics` records to, by key (one entry per metric)."""

MAX_LABEL_VALUES: Final = 50
"""Distinct values a configuration-driven label (model, cap, action, ...) may take; the rest
are counted under ``"other"``."""

_MAX_LABEL_LENGTH = 64


class _Bounded:
    """Maps label values onto at most ``limit`` distinct ones (then ``"other"``).

    Values in ``known`` (a fixed set the code defines) pass without taking a place.
    """

    def __init__(self, limit: int = MAX_LABEL_VALUES, known: frozenset[str] = frozenset()) -> None:
        self.limit = limit
        self.known = known
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: object) -> str:
        text = str(value or "unknown")[:_MAX_LABEL_LENGTH]
        if text in self._seen or text in self.known:
            return text
        # A lone surrogate (bytes decoded with surrogateescape) cannot be encoded: in a label
        # it failed every later scrape of the whole registry. Spans escape it the same way.
        text = escaped_surrogates(text)
        with self._lock:
            if text in self._seen:
                return text
            if len(self._seen) >= self.limit:
                return "other"
            self._seen.add(text)
        return text


@dataclass(frozen=True, slots=True)
class _ModelSeries:
    """The label children a successful live model call updates, and its bounded labels."""

    provider: str
    model: str
    first_chunk: Any
    call_seconds: Any
    input_tokens: Any
    output_tokens: Any
    cost: Any


# Model names come from configuration, but a caller may pass anything: past this many the
# series are resolved per call (the labels themselves are bounded either way).
_MAX_MODEL_SERIES = 256


@dataclass(eq=False)
class _Collectors:
    """The metric families of one registry (shared by every :class:`Metrics` on it)."""

    steps: Counter
    step_seconds: Histogram
    write_seconds: Histogram
    runs: Counter
    tokens: Counter
    cost: Counter
    budget_denials: Counter
    permission_decisions: Counter
    guardrail_trips: Counter
    audit_entries: Counter
    store_unavailable: Counter
    model_errors: Counter
    model_retries: Counter
    tool_errors: Counter
    run_seconds: Histogram
    cache_tokens: Counter
    model_call_seconds: Histogram
    first_chunk_seconds: Histogram
    runs_by_state: Gauge
    recoveries: Counter
    recovery_delay: Histogram
    bounded: dict[str, _Bounded] = field(default_factory=dict)
    instrumented: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    prepared: set[str] = field(default_factory=set)
    # The label children of each (backend, kind, outcome): every step updates three series,
    # and resolving labels takes a lock and a dict lookup each time.
    step_children: dict[tuple[str, str, str], tuple[Any, Any, Any]] = field(default_factory=dict)
    # The same for the series every live model call updates, per (provider, model) as given.
    model_children: dict[tuple[str, str], _ModelSeries] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bound(self, label: str, value: object) -> str:
        guard = self.bounded.get(label)
        if guard is None:
            guard = self.bounded.setdefault(label, _Bounded())
        return guard(value)


def _build(registry: CollectorRegistry) -> _Collectors:
    r = registry
    built = _Collectors(
        steps=Counter(
            "loomflow_journal_steps",
            "Journaled steps by replay outcome (hit, miss, divergence, corrupt).",
            ("backend", "kind", "outcome"),
            registry=r,
        ),
        step_seconds=Histogram(
            "loomflow_step_duration_seconds",
            "Wall time of a journaled step: lookup, the call on a miss, and the journal write.",
            ("backend", "kind", "outcome"),
            buckets=STEP_BUCKETS,
            registry=r,
        ),
        write_seconds=Histogram(
            "loomflow_journal_write_seconds",
            "Time to write (and commit) one journal entry.",
            ("backend",),
            buckets=JOURNAL_WRITE_BUCKETS,
            registry=r,
        ),
        runs=Counter(
            "loomflow_runs",
            "Agent runs by how they ended and whether they resumed a journaled run.",
            ("backend", "outcome", "resumed"),
            registry=r,
        ),
        tokens=Counter(
            "loomflow_model_tokens",
            "Tokens of live model calls (replayed calls cost nothing and are not counted).",
            ("provider", "model", "type"),
            registry=r,
        ),
        cost=Counter(
            "loomflow_model_cost_usd",
            "Estimated USD cost of live model calls.",
            ("provider", "model"),
            registry=r,
        ),
        budget_denials=Counter(
            "loomflow_budget_denials",
            "Model calls refused by the budget, by cap ('unavailable': the store failed).",
            ("cap",),
            registry=r,
        ),
        permission_decisions=Counter(
            "loomflow_permission_decisions",
            "Permission decisions on live tool calls: the first answer and the final one.",
            ("decision", "final"),
            registry=r,
        ),
        guardrail_trips=Counter(
            "loomflow_guardrail_trips",
            "Guardrails that blocked or redacted input, output or a tool result.",
            ("stage", "action"),
            registry=r,
        ),
        audit_entries=Counter(
            "loomflow_audit_entries",
            "Entries appended to the audit log, by action.",
            ("action",),
            registry=r,
        ),
        store_unavailable=Counter(
            "loomflow_store_unavailable",
            "Operations refused because a store (journal, budget, audit) failed underneath.",
            ("store",),
            registry=r,
        ),
        model_errors=Counter(
            "loomflow_model_errors",
            "Live model calls that failed (after any retries), by provider, model and error class.",
            ("provider", "model", "error"),
            registry=r,
        ),
        model_retries=Counter(
            "loomflow_model_retries",
            "Provider requests attempted again after a transient failure, by error class.",
            ("provider", "model", "error"),
            registry=r,
        ),
        tool_errors=Counter(
            "loomflow_tool_errors",
            "Executed tool calls that returned an error, by tool and error type.",
            ("tool", "error_type"),
            registry=r,
        ),
        run_seconds=Histogram(
            "loomflow_run_duration_seconds",
            "Wall time of an agent run, from its start to its end, by how it ended.",
            ("outcome",),
            buckets=RUN_BUCKETS,
            registry=r,
        ),
        cache_tokens=Counter(
            "loomflow_model_cache_tokens",
            "Input tokens of live model calls read from (read) or written to (write) a prompt "
            "cache; they are part of the input tokens of loomflow_model_tokens_total.",
            ("provider", "model", "type"),
            registry=r,
        ),
        model_call_seconds=Histogram(
            "loomflow_model_call_duration_seconds",
            "Wall time of a live model call, by error class ('none' when it succeeded).",
            ("provider", "model", "error"),
            buckets=GEN_AI_DURATION_BUCKETS,
            registry=r,
        ),
        first_chunk_seconds=Histogram(
            "loomflow_model_time_to_first_chunk_seconds",
            "Time from a streamed model call's request to its first streamed chunk.",
            ("provider", "model"),
            buckets=GEN_AI_DURATION_BUCKETS,
            registry=r,
        ),
        runs_by_state=Gauge(
            "loomflow_runs_by_state",
            "Runs of the journal by state (each session's last run), as of the last sweep.",
            ("state", "backend"),
            registry=r,
        ),
        recoveries=Counter(
            "loomflow_recoveries",
            "What recoverers did with orphaned runs, by outcome.",
            ("outcome",),
            registry=r,
        ),
        recovery_delay=Histogram(
            "loomflow_recovery_delay_seconds",
            "Time from a run being orphaned (its lease ran out) to a recoverer resuming it.",
            buckets=RECOVERY_BUCKETS,
            registry=r,
        ),
    )
    # Series born at their first increment hide that increment from increase() and rate():
    # the label sets that can occur are known and few, so they exist at 0 from the start.
    built.bounded["cap"] = _Bounded(known=frozenset(BUDGET_CAPS))
    built.bounded["guardrail_action"] = _Bounded(known=frozenset(get_args(GuardrailAction)))
    # loomflow's own audit actions take no place: the 50 are the application's.
    built.bounded["audit_action"] = _Bounded(known=frozenset(AUDIT_ACTIONS + KEPT_BY_ERASURE))
    for cap in BUDGET_CAPS:
        built.budget_denials.labels(cap)
    for store in STORES:
        built.store_unavailable.labels(store)
    for run_outcome in RUN_OUTCOMES:
        built.run_seconds.labels(run_outcome)
    for recovery_outcome in RECOVERY_OUTCOMES:
        built.recoveries.labels(recovery_outcome)
    return built


# A registry refuses a second family with the same name, so every Metrics on one registry
# shares one set of collectors.
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Collectors] = (
    weakref.WeakKeyDictionary()
)
_by_registry_lock = threading.Lock()


def _collectors_for(registry: CollectorRegistry) -> _Collectors:
    with _by_registry_lock:
        found = _by_registry.get(registry)
        if found is None:
            found = _by_registry[registry] = _build(registry)
        return found


# Which store's code a StoreUnavailableError was raised under, by module: the innermost one
# on its traceback decides (the journal's step wraps memory writes and tool bodies, say).
_STORE_MODULES: Final = (
    ("loomflow.runtime", "journal"),
    ("loomflow.audit", "audit"),
    ("loomflow.memory", None),
    ("loomflow.checkpoints", None),
    ("loomflow.governance", None),  # the budget store: counted as a denial at "unavailable"
)
# A failure that ends a sub-agent's run and then its caller's is one failure of the store.
_counted_failures: weakref.WeakSet[BaseException] = weakref.WeakSet()


def _failed_store(exc: BaseException) -> str | None:
    store = None
    frame = exc.__traceback__
    while frame is not None:
        module = frame.tb_frame.f_globals.get("__name__", "")
        for prefix, name in _STORE_MODULES:
            if module == prefix or module.startswith(prefix + "."):
                store = name
                break
        frame = frame.tb_next
    return store


class Metrics:
    """loomflow's metrics: Prometheus families on one registry, and OpenTelemetry instruments.

    Every recording method feeds both from here, with the same bounded attributes: the
    Prometheus series (pulled from ``registry``) and the OTel instruments of
    :data:`OTEL_INSTRUMENTS` (pushed by whatever reader the meter provider has).

    Args:
        registry: Where the Prometheus families live; ``None`` is prometheus-client's default
            registry (what ``start_http_server`` and most frameworks expose). Several
            ``Metrics`` on one registry share the same series.
        meter_provider: Where the OTel measurements go; ``None`` is the global meter provider,
            a no-op until the application installs an SDK one (set later is fine).
        otel: ``False`` for Prometheus only.

    Feed it by giving it to ``Telemetry(metrics=...)`` (agents), by :meth:`instrument` (any
    journaled runtime) and :meth:`count_audit` (an audit log), or by calling the recording
    methods directly.

    Example:
        >>> registry = CollectorRegistry()
        >>> metrics = Metrics(registry)
        >>> metrics.audit_entry("run.start")
        >>> registry.get_sample_value("loomflow_audit_entries_total", {"action": "run.start"})
        1.0
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        meter_provider: MeterProvider | None = None,
        otel: bool = True,
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.meter_provider = meter_provider
        self._c = _collectors_for(self.registry)
        self._o: Instruments | None = (
            instruments_for(meter_provider, OTEL_INSTRUMENTS) if otel else None
        )
        # The OTel attributes of each (backend, kind, outcome), built once like the label
        # children: every step records three measurements.
        self._step_attrs: dict[tuple[str, str, str], tuple[dict[str, str], dict[str, str]]] = {}

    def __repr__(self) -> str:
        return f"Metrics(registry={self.registry!r}, otel={self._o is not None})"

    def instrument(self, runtime: Any) -> None:
        """Count every journaled step of ``runtime`` (idempotent per registry, and per meter
        provider, and runtime).

        The replay series of the runtime's backend are created at 0 right away, so that rates
        and alerts see a series before its first increment.
        """
        # The agent's no-journal passthrough has no observers: nothing is journaled.
        # Prometheus series are counted once per registry and OTel measurements once per
        # meter provider: two Metrics on one registry with their own meter providers (the
        # default telemetry and an agent's Telemetry(meter_provider=...)) each get the steps.
        if self._observe_once(runtime, self._step_series, self._c.instrumented, self._c.lock):
            self.prepare_backend(str(runtime.backend))
        if self._o is not None:
            self._observe_once(runtime, self._step_measures, self._o.observed, self._o.lock)

    @staticmethod
    def _observe_once(
        source: Any,
        observer: Callable[[Any], None],
        seen: weakref.WeakSet[Any],
        lock: threading.Lock,
    ) -> bool:
        """Add ``observer`` to ``source`` unless ``seen`` has it (a registry's, or a meter
        provider's instruments'); ``False`` when it was added before, or ``source`` takes no
        observers."""
        add_observer = getattr(source, "add_observer", None)
        if add_observer is None:
            return False
        with lock:
            if source in seen:
                return False
            seen.add(source)
        add_observer(observer)
        return True

    def prepare_backend(self, backend: str) -> None:
        """Create the step and run series of ``backend`` at 0."""
        backend = self._c.bound("backend", backend)
        if backend in self._c.prepared:
            return
        self._c.prepared.add(backend)
        for kind in KINDS:
            for outcome in OUTCOMES:
                self._c.steps.labels(backend, kind, outcome)
        for run_outcome in RUN_OUTCOMES:
            for resumed in ("true", "false"):
                self._c.runs.labels(backend, run_outcome, resumed)

    def observe_step(self, event: StepEvent) -> None:
        """Record one journaled step (a runtime observer: ``runtime.add_observer(...)``)."""
        self._step_series(event)
        self._step_measures(event)

    def _step_series(self, event: StepEvent) -> None:
        """The Prometheus part of :meth:`observe_step`."""
        key = (event.backend, event.kind, event.outcome)
        children = self._c.step_children.get(key)
        if children is None:
            backend, kind, outcome = self._step_labels(event)
            children = self._c.step_children[key] = (
                self._c.steps.labels(backend, kind, outcome),
                self._c.step_seconds.labels(backend, kind, outcome),
                self._c.write_seconds.labels(backend),
            )
        steps, step_seconds, write_seconds = children
        steps.inc()
        step_seconds.observe(event.duration_s)
        if event.write_s > 0:  # only a step that wrote an entry has a write time
            write_seconds.observe(event.write_s)

    def _step_measures(self, event: StepEvent) -> None:
        """The OpenTelemetry part of :meth:`observe_step`."""
        if self._o is not None:
            key = (event.backend, event.kind, event.outcome)
            attrs = self._step_attrs.get(key)
            if attrs is None:
                backend, kind, outcome = self._step_labels(event)
                attrs = self._step_attrs[key] = (
                    {"backend": backend, "kind": kind, "outcome": outcome},
                    {"backend": backend},
                )
            by_key = self._o.by_key
            by_key["steps"].add(1, attrs[0])
            by_key["step_seconds"].record(event.duration_s, attrs[0])
            if event.write_s > 0:
                by_key["write_seconds"].record(event.write_s, attrs[1])

    def _step_labels(self, event: StepEvent) -> tuple[str, str, str]:
        return (
            self._c.bound("backend", event.backend),
            event.kind if event.kind in KINDS else "custom",
            event.outcome if event.outcome in OUTCOMES else "miss",
        )

    def run_finished(
        self, *, backend: str, outcome: str, resumed: bool, duration_s: float | None = None
    ) -> None:
        """Count a run that ended with ``outcome`` (one of :data:`RUN_OUTCOMES`), and observe
        its wall time ``duration_s`` when given."""
        if outcome not in RUN_OUTCOMES:
            raise InvalidArgumentError(
                f"run outcome must be one of {RUN_OUTCOMES}, not {outcome!r}"
            )
        backend = self._c.bound("backend", backend)
        was_resumed = "true" if resumed else "false"
        self._c.runs.labels(backend, outcome, was_resumed).inc()
        if self._o is not None:
            self._o.add("runs", 1, {"backend": backend, "outcome": outcome, "resumed": was_resumed})
        if duration_s is not None:
            seconds = max(duration_s, 0.0)
            self._c.run_seconds.labels(outcome).observe(seconds)
            if self._o is not None:
                self._o.record("run_seconds", seconds, {"outcome": outcome})

    def prepare_model(self, provider: str, model: str) -> None:
        """Create the error and retry series of ``provider``/``model`` at 0 (for ratios)."""
        provider, model = self._model_labels(provider, model)
        # Keyed on the bounded labels: the raw names a caller passes are unbounded.
        key = f"model\x00{provider}\x00{model}"  # every run calls this: once is enough
        if key in self._c.prepared:
            return
        self._c.prepared.add(key)
        for error in ERROR_CLASSES:
            self._c.model_errors.labels(provider, model, error)
            self._c.model_retries.labels(provider, model, error)

    def _model_labels(self, provider: str, model: str) -> tuple[str, str]:
        return self._c.bound("provider", provider), self._c.bound("model", model)

    def _model_series(self, provider: str, model: str) -> _ModelSeries:
        series = self._c.model_children.get((provider, model))
        if series is None:
            p, m = self._model_labels(provider, model)
            c = self._c
            series = _ModelSeries(
                p,
                m,
                c.first_chunk_seconds.labels(p, m),
                c.model_call_seconds.labels(p, m, "none"),
                c.tokens.labels(p, m, "input"),
                c.tokens.labels(p, m, "output"),
                c.cost.labels(p, m),
            )
            if len(c.model_children) < _MAX_MODEL_SERIES:
                c.model_children[(provider, model)] = series
        return series

    def _gen_ai(self, provider: str, model: str) -> dict[str, str]:
        """The GenAI attributes of a chat call (provider and model already bounded)."""
        return {
            sc.GEN_AI_OPERATION_NAME: "chat",
            sc.GEN_AI_PROVIDER_NAME: provider,
            sc.GEN_AI_REQUEST_MODEL: model,
        }

    def model_error(self, *, provider: str, model: str, error: str) -> None:
        """Count a live model call that failed with ``error`` (one of :data:`ERROR_CLASSES`)."""
        provider, model = self._model_labels(provider, model)
        error = error if error in ERROR_CLASSES else "other"
        self._c.model_errors.labels(provider, model, error).inc()
        if self._o is not None:
            self._o.add("model_errors", 1, {"provider": provider, "model": model, "error": error})

    def model_retry(self, *, provider: str, model: str, error: str) -> None:
        """Count one retry of a provider request after a transient ``error``."""
        provider, model = self._model_labels(provider, model)
        error = error if error in ERROR_CLASSES else "other"
        self._c.model_retries.labels(provider, model, error).inc()
        if self._o is not None:
            self._o.add("model_retries", 1, {"provider": provider, "model": model, "error": error})

    def model_call(
        self, *, provider: str, model: str, duration_s: float, error: str | None = None
    ) -> None:
        """Observe the wall time of one live model call; ``error`` (an error class, or
        ``"cancelled"``) when it failed."""
        seconds = max(duration_s, 0.0)
        if error is None:
            series = self._model_series(provider, model)
            series.call_seconds.observe(seconds)
            provider, model = series.provider, series.model
        else:
            provider, model = self._model_labels(provider, model)
            if error not in ERROR_CLASSES and error != "cancelled":
                error = "other"
            self._c.model_call_seconds.labels(provider, model, error).observe(seconds)
        if self._o is not None:
            attributes = self._gen_ai(provider, model)
            if error is not None:
                attributes[sc.ERROR_TYPE] = error
            self._o.record("operation_duration", seconds, attributes)

    def model_first_chunk(self, *, provider: str, model: str, seconds: float) -> None:
        """Observe the time a streamed live model call took to yield its first chunk."""
        series = self._model_series(provider, model)
        seconds = max(seconds, 0.0)
        series.first_chunk.observe(seconds)
        if self._o is not None:
            self._o.record(
                "time_to_first_chunk", seconds, self._gen_ai(series.provider, series.model)
            )

    def tool_error(self, *, tool: str, error_type: str | None) -> None:
        """Count an executed tool call that returned an error of ``error_type``."""
        kind = error_type if error_type in TOOL_ERROR_TYPES else "other"
        tool = self._c.bound("tool", tool)
        self._c.tool_errors.labels(tool, kind).inc()
        if self._o is not None:
            self._o.add("tool_errors", 1, {"tool": tool, "error_type": kind})

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
    ) -> None:
        """Count the tokens and cost of one live model call.

        ``input_tokens`` is every input token, cache reads and writes included (as the GenAI
        conventions count them); the cache figures are also counted on their own.
        """
        series = self._model_series(provider, model)
        provider, model = series.provider, series.model
        inputs, outputs = max(input_tokens, 0), max(output_tokens, 0)
        reads, writes = max(cache_read_tokens, 0), max(cache_write_tokens, 0)
        # A NaN would stay in the counter for good (and inf too): a custom price table's bad
        # figure is not counted rather than spoiling every later rate of the series.
        cost = cost_usd if cost_usd is not None and 0.0 < cost_usd < math.inf else 0.0
        series.input_tokens.inc(inputs)
        series.output_tokens.inc(outputs)
        if cost:
            series.cost.inc(cost)
        if reads:
            self._c.cache_tokens.labels(provider, model, "read").inc(reads)
        if writes:
            self._c.cache_tokens.labels(provider, model, "write").inc(writes)
        if self._o is None:
            return
        attributes = self._gen_ai(provider, model)
        self._o.record("token_usage", inputs, {**attributes, sc.GEN_AI_TOKEN_TYPE: "input"})
        self._o.record("token_usage", outputs, {**attributes, sc.GEN_AI_TOKEN_TYPE: "output"})
        labels = {"provider": provider, "model": model}
        self._o.add("cost", cost, labels)
        if reads:
            self._o.add("cache_tokens", reads, {**labels, "type": "read"})
        if writes:
            self._o.add("cache_tokens", writes, {**labels, "type": "write"})

    def budget_denied(self, cap: str) -> None:
        """Count a model call the budget refused at ``cap``.

        ``"unavailable"`` (the budget store failed) also counts as a failure of the budget
        store in ``loomflow_store_unavailable_total``.
        """
        cap = self._c.bound("cap", cap)
        self._c.budget_denials.labels(cap).inc()
        if self._o is not None:
            self._o.add("budget_denials", 1, {"cap": cap})
        if cap == "unavailable":
            self.store_unavailable("budget")

    def store_unavailable(self, store: str) -> None:
        """Count an operation refused because ``store`` (one of :data:`STORES`) failed."""
        if store not in STORES:
            raise InvalidArgumentError(f"store must be one of {STORES}, not {store!r}")
        self._c.store_unavailable.labels(store).inc()
        if self._o is not None:
            self._o.add("store_unavailable", 1, {"store": store})

    def store_failed(self, exc: BaseException) -> None:
        """Count ``exc`` in ``loomflow_store_unavailable_total`` when it is the failure of the
        journal or the audit store (a :class:`StoreUnavailableError` raised under their code),
        once however many runs and sweeps it passes through."""
        if not isinstance(exc, StoreUnavailableError) or exc in _counted_failures:
            return
        _counted_failures.add(exc)
        store = _failed_store(exc)
        if store is not None:
            self.store_unavailable(store)

    def permission_decided(self, decision: str, final: str) -> None:
        """Count a permission decision (``allow``/``deny``/``ask``) and its final answer."""
        decision, final = self._c.bound("decision", decision), self._c.bound("final", final)
        self._c.permission_decisions.labels(decision, final).inc()
        if self._o is not None:
            self._o.add("permission_decisions", 1, {"decision": decision, "final": final})

    def guardrail_tripped(self, stage: str, action: str) -> None:
        """Count a guardrail that acted (``block``/``redact``) at ``stage``."""
        # Each metric's "action" label has its own budget: the application's audit actions
        # must not use up the places of the guardrail's two.
        stage, action = self._c.bound("stage", stage), self._c.bound("guardrail_action", action)
        self._c.guardrail_trips.labels(stage, action).inc()
        if self._o is not None:
            self._o.add("guardrail_trips", 1, {"stage": stage, "action": action})

    def count_audit(self, audit: Any) -> None:
        """Count every entry the audit log ``audit`` appends, by action (idempotent per
        registry and audit log, and per meter provider). An agent does it for its own audit
        log and telemetry."""
        # Once per registry and once per meter provider, as the steps of instrument().
        self._observe_once(audit, self._audit_series, self._c.instrumented, self._c.lock)
        if self._o is not None:
            self._observe_once(audit, self._audit_measure, self._o.observed, self._o.lock)

    def _audit_series(self, entry: Any) -> None:
        self._c.audit_entries.labels(self._c.bound("audit_action", str(entry.action))).inc()

    def _audit_measure(self, entry: Any) -> None:
        if self._o is not None:
            action = self._c.bound("audit_action", str(entry.action))
            self._o.add("audit_entries", 1, {"action": action})

    def audit_entry(self, action: str) -> None:
        """Count one audit-log entry of ``action`` (see :meth:`count_audit`)."""
        action = self._c.bound("audit_action", action)
        self._c.audit_entries.labels(action).inc()
        if self._o is not None:
            self._o.add("audit_entries", 1, {"action": action})

    def prepare_permissions(self) -> None:
        """Create the permission series at 0 (so that a spike alert has a baseline)."""
        for decision, final in (
            ("allow", "allow"),
            ("deny", "deny"),
            ("ask", "allow"),
            ("ask", "deny"),
        ):
            self._c.permission_decisions.labels(decision, final)

    def runs_by_state(self, backend: str, counts: dict[str, int]) -> None:
        """Set the runs-by-state gauge of ``backend`` from a sweep's count (every state set,
        zeros included, so a state that empties reads 0 rather than its last value)."""
        backend = self._c.bound("backend", backend)
        # "unreadable" too: `runs list` shows hand-edited rows so, and the gauge adds up to it.
        for state in (*RUN_STATES, UNREADABLE):
            count = max(counts.get(state, 0), 0)
            self._c.runs_by_state.labels(state, backend).set(count)
            if self._o is not None:
                self._o.set("runs_by_state", count, {"backend": backend, "state": state})

    def recovery(self, outcome: str) -> None:
        """Count one thing a recoverer did (one of :data:`RECOVERY_OUTCOMES`)."""
        if outcome not in RECOVERY_OUTCOMES:
            raise InvalidArgumentError(
                f"recovery outcome must be one of {RECOVERY_OUTCOMES}, not {outcome!r}"
            )
        self._c.recoveries.labels(outcome).inc()
        if self._o is not None:
            self._o.add("recoveries", 1, {"outcome": outcome})

    def recovery_delay(self, seconds: float) -> None:
        """Record how long a run waited orphaned before a recoverer resumed it."""
        self._c.recovery_delay.observe(max(0.0, seconds))
        if self._o is not None:
            self._o.record("recovery_delay", max(0.0, seconds), {})

    def as_hooks(self) -> Any:
        """These metrics, without tracing, as agent hooks: ``Agent(telemetry=metrics)``."""
        self.prepare_permissions()
        return TelemetryHooks(None, self, content=False)


@dataclass(eq=False)
class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` (or ``with``) stops it."""

    host: str
    port: int
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        """The scrape URL, e.g. ``http://127.0.0.1:9464/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(
    port: int, *, host: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve ``registry`` (default: prometheus-client's) at ``http://host:port/metrics``.

    The server runs in a daemon thread. ``port=0`` picks a free port (read it from
    ``server.port``). Bind ``host="0.0.0.0"`` to be scraped from another container.

    Raises:
        ConfigurationError: the port cannot be bound (in use, or a host this machine lacks).

    Example:
        >>> with serve_metrics(0) as server:  # doctest: +SKIP
        ...     print(server.url)
    """
    registry = REGISTRY if registry is None else registry
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # a port in use, an address this host does not have
        raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    server.set_app(_with_head(make_wsgi_app(registry)))
    return MetricsServer(
        host=host, port=int(server.server_address[1]), _server=server, _thread=thread
    )


def _with_head(app: Callable[..., Any]) -> Callable[..., Any]:
    """``app`` (prometheus-client's WSGI app, which answers HEAD with 405) answering HEAD as it
    answers GET, without the body: probes and load balancers often check with HEAD."""

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, start_response)
        answer: list[Any] = []

        def keep(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            answer[:] = [status, headers]
            return lambda data: None

        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, keep))
        status, headers = answer
        if not any(name.lower() == "content-length" for name, _ in headers):
            headers = [*headers, ("Content-Length", str(len(body)))]
        start_response(status, headers)
        return []

    return serve
