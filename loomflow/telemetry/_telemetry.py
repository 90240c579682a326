"""The telemetry of agent runs: a tracer and metrics, handed to the loop as hooks.

The hooks themselves (span tree, context propagation) are in ``_hooks``; :class:`Metrics` can
build them too (``Agent(telemetry=metrics)``), so they sit below both.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer, TracerProvider

from ..config import Settings
from ..hooks import RunHooks
from ._hooks import TelemetryHooks, instrument
from ._metrics import Metrics

__all__ = ["Telemetry"]

try:
    _VERSION: str | None = importlib.metadata.version("loomflow")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    _VERSION = None


class Telemetry:
    """Traces and metrics of agent runs; give it to ``Agent(telemetry=...)``.

    Spans go through ``opentelemetry-api`` and cost nothing until an SDK is configured (by the
    application, or by :func:`~loomflow.telemetry.setup_telemetry` from settings). Metrics go to
    a Prometheus registry; serve them with :func:`~loomflow.telemetry.serve_metrics`.

    Args:
        tracer_provider: Where spans go; ``None`` is the global provider (set later is fine).
        metrics: ``True`` for :class:`Metrics` on prometheus-client's default registry, a
            :class:`Metrics` for another registry, ``False`` for no metrics.
        tracing: ``False`` for metrics only.
        capture_content: Record prompts, completions, tool arguments and tool results on
            spans. Off by default; ``None`` reads ``LOOMFLOW_TELEMETRY_CAPTURE_CONTENT``.
            Recorded text is scrubbed by the agent's redactor first (secret shapes and
            configured secrets; sensitive tool arguments are already sealed placeholders).
        settings: Where ``capture_content=None`` is read from (default: the environment).

    The first run of an agent instruments the agent's runtime (steps become spans and are
    counted); call :meth:`instrument` to trace a runtime used without an agent.

    Example:
        >>> telemetry = Telemetry(metrics=Metrics(CollectorRegistry()))  # doctest: +SKIP
        >>> agent = Agent("...", model="scripted", runtime=runtime, telemetry=telemetry)
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        metrics: Metrics | bool = True,
        tracing: bool = True,
        capture_content: bool | None = None,
        settings: Settings | None = None,
    ) -> None:
        if capture_content is None:
            capture_content = (settings or Settings()).telemetry_capture_content
        self.capture_content = capture_content
        self.tracer: Tracer | None = (
            trace.get_tracer("loomflow", _VERSION, tracer_provider=tracer_provider)
            if tracing
            else None
        )
        if metrics is True:
            metrics = Metrics()
        self.metrics: Metrics | None = metrics or None
        if self.metrics is not None:
            self.metrics.prepare_permissions()
        self._hooks = TelemetryHooks(self.tracer, self.metrics, content=capture_content)

    def __repr__(self) -> str:
        return (
            f"Telemetry(tracing={self.tracer is not None}, metrics={self.metrics!r}, "
            f"capture_content={self.capture_content})"
        )

    def as_hooks(self) -> RunHooks:
        """The hooks the agent loop calls (the agent does this itself)."""
        return self._hooks

    def instrument(self, runtime: Any) -> None:
        """Trace and count every journaled step of ``runtime`` (idempotent).

        A runtime is traced by the first ``Telemetry`` that instruments it; a runtime without
        a journal (an agent with ``runtime=None``) has no steps and is left alone.
        """
        instrument(runtime, self.tracer, self.metrics)
