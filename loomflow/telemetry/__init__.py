"""Observability of agent runs: OpenTelemetry spans and Prometheus metrics.

``Agent(telemetry=Telemetry())`` traces every run (``invoke_agent``), every journaled step
(``loom.workflow.step``) and every live model and tool call (``chat``, ``execute_tool``), and
counts replay hits, misses and divergences, step and journal-write latencies, runs, tokens,
cost and governance decisions, as Prometheus series and, from the same calls, as OpenTelemetry
metrics (the GenAI client metrics and ``loomflow.*``). No metric label or attribute carries a
user, session or run id.

Library code depends on ``opentelemetry-api`` only: spans and OTel metrics are free until an SDK
is configured, by the application or by :func:`setup_telemetry` from the standard ``OTEL_*``
variables (``LOOMFLOW_OTLP_*`` override them).
"""

from __future__ import annotations

from ._metrics import (
    BUDGET_CAPS,
    ERROR_CLASSES,
    GEN_AI_DURATION_BUCKETS,
    GEN_AI_TOKEN_BUCKETS,
    JOURNAL_WRITE_BUCKETS,
    KINDS,
    MAX_LABEL_VALUES,
    OTEL_INSTRUMENTS,
    OUTCOMES,
    RUN_BUCKETS,
    RUN_OUTCOMES,
    STEP_BUCKETS,
    STORES,
    TOOL_ERROR_TYPES,
    Metrics,
    MetricsServer,
    serve_metrics,
)
from ._semconv import STEP_SPAN
from ._setup import TelemetrySetup, setup_requested, setup_telemetry, setup_telemetry_once
from ._telemetry import Telemetry, default_telemetry

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
    "RUN_BUCKETS",
    "RUN_OUTCOMES",
    "STEP_BUCKETS",
    "STEP_SPAN",
    "STORES",
    "TOOL_ERROR_TYPES",
    "Telemetry",
    "TelemetrySetup",
    "default_telemetry",
    "serve_metrics",
    "setup_requested",
    "setup_telemetry",
    "setup_telemetry_once",
]
