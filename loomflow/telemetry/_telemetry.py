"""The telemetry of agent runs: a tracer and metrics, handed to the loop as hooks.

The hooks themselves (span tree, context propagation) are in ``_hooks``; :class:`Metrics` can
build them too (``Agent(telemetry=metrics)``), so they sit below both.
"""

from __future__ import annotations

import importlib.metadata
import threading
from typing import Any

from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import Tracer, TracerProvider

from ..config import Settings
from ..errors import ConfigurationError
from ..hooks import RunHooks
from ._hooks import USER_ID_MODES, TelemetryHooks, UserIdMode, UserIds, instrument
from ._metrics import Metrics

__all__ = ["Telemetry", "default_telemetry"]

try:
    _VERSION: str | None = importlib.metadata.version("loomflow")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    _VERSION = None


class Telemetry:
    """Traces and metrics of agent runs; give it to ``Agent(telemetry=...)``.

    Spans go through ``opentelemetry-api`` and cost nothing until an SDK is configured (by the
    application, or by :func:`~loomflow.telemetry.setup_telemetry` from settings). Metrics go to
    a Prometheus registry (serve it with :func:`~loomflow.telemetry.serve_metrics`) and, from
    the same recording calls, to OpenTelemetry instruments of the meter provider.

    Args:
        tracer_provider: Where spans go; ``None`` is the global provider (set later is fine).
        metrics: ``True`` for :class:`Metrics` on prometheus-client's default registry and
            ``meter_provider``, a :class:`Metrics` of your own, ``False`` for no metrics.
        meter_provider: Where OTel metrics go when ``metrics=True``; ``None`` is the global
            meter provider (a no-op until the application installs an SDK one).
        tracing: ``False`` for metrics only.
        capture_content: Record prompts, completions, tool arguments and tool results on
            spans. Off by default; ``None`` reads ``LOOMFLOW_TELEMETRY_CAPTURE_CONTENT``.
            Recorded text is scrubbed by the agent's redactor first (secret shapes and
            configured secrets; sensitive tool arguments are already sealed placeholders).
        user_ids: How spans carry the run's user id (``user_id`` and ``user.id``): ``"plain"``,
            ``"hashed"`` (HMAC-SHA-256 under ``user_id_key``, first 16 hex digits, prefixed
            ``h:``) or ``"omit"``; ``None`` reads ``LOOMFLOW_TELEMETRY_USER_IDS``.
        user_id_key: The secret of ``"hashed"``; ``None`` reads
            ``LOOMFLOW_TELEMETRY_USER_ID_KEY``. Share it across a deployment's processes.
        settings: Where ``None`` options are read from (default: the environment).

    The first run of an agent instruments the agent's runtime (steps become spans and are
    counted); call :meth:`instrument` to trace a runtime used without an agent. Agents that
    share a runtime each trace their own runs' steps, with their own provider and ``user_ids``.

    Example:
        >>> telemetry = Telemetry(metrics=Metrics(CollectorRegistry()))  # doctest: +SKIP
        >>> agent = Agent("...", model="scripted", runtime=runtime, telemetry=telemetry)
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        metrics: Metrics | bool = True,
        meter_provider: MeterProvider | None = None,
        tracing: bool = True,
        capture_content: bool | None = None,
        user_ids: UserIdMode | None = None,
        user_id_key: str | bytes | None = None,
        settings: Settings | None = None,
    ) -> None:
        if capture_content is None or user_ids is None or user_id_key is None:
            settings = settings or Settings()
        if capture_content is None:
            assert settings is not None
            capture_content = settings.telemetry_capture_content
        if user_ids is None:
            assert settings is not None
            user_ids = settings.telemetry_user_ids
        if user_ids not in USER_ID_MODES:
            raise ConfigurationError(
                f"user_ids must be one of {', '.join(USER_ID_MODES)}, not {user_ids!r}"
            )
        key: bytes | None = None
        if user_ids == "hashed":
            if user_id_key is None:
                assert settings is not None
                secret = settings.telemetry_user_id_key
                user_id_key = secret.get_secret_value() if secret is not None else None
            if user_id_key is None or len(user_id_key) < 16:
                raise ConfigurationError(
                    "user_ids='hashed' needs a secret key of 16 characters or more "
                    "(user_id_key=, or LOOMFLOW_TELEMETRY_USER_ID_KEY): without one the "
                    "hashes could be reversed by hashing candidate ids"
                )
            key = user_id_key.encode("utf-8") if isinstance(user_id_key, str) else user_id_key
        self.user_ids: UserIdMode = user_ids
        self._user_ids = UserIds(user_ids, key)
        self.capture_content = capture_content
        self.tracer: Tracer | None = (
            trace.get_tracer("loomflow", _VERSION, tracer_provider=tracer_provider)
            if tracing
            else None
        )
        if metrics is True:
            metrics = Metrics(meter_provider=meter_provider)
        self.metrics: Metrics | None = metrics or None
        if self.metrics is not None:
            self.metrics.prepare_permissions()
        self._hooks = TelemetryHooks(
            self.tracer, self.metrics, content=capture_content, user_ids=self._user_ids
        )

    def __repr__(self) -> str:
        return (
            f"Telemetry(tracing={self.tracer is not None}, metrics={self.metrics!r}, "
            f"capture_content={self.capture_content}, user_ids={self.user_ids!r})"
        )

    def as_hooks(self) -> RunHooks:
        """The hooks the agent loop calls (the agent does this itself)."""
        return self._hooks

    def instrument(self, runtime: Any) -> None:
        """Trace and count every journaled step of ``runtime`` (idempotent).

        The steps of an agent's run follow that agent's telemetry; steps made outside any
        agent's run follow the first ``Telemetry`` that instrumented the runtime. A runtime
        without a journal (an agent with ``runtime=None``) has no steps and is left alone.
        """
        instrument(runtime, self.tracer, self.metrics, self._user_ids)


_default: Telemetry | None = None
_default_lock = threading.Lock()


def default_telemetry() -> Telemetry:
    """The telemetry of every agent built without ``telemetry=`` (one per process).

    Spans go to the global tracer provider through a proxy tracer, so a provider the
    application installs later still gets them (until then they are the API's no-ops); metrics
    go to prometheus-client's default registry and to the global meter provider (a proxy meter
    too: measurements are no-ops until an SDK provider is installed). Options are read from
    the environment when the first such agent is built. One shared instance, so the default
    registry holds each metric family once however many agents a process builds.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = Telemetry()
        return _default
