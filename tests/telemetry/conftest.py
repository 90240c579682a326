"""Fixtures of the telemetry tests: an in-memory span exporter and a private metrics registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from loomflow.telemetry import Metrics, Telemetry
from loomflow.telemetry.testing import SpanCapture


@pytest.fixture
def capture() -> SpanCapture:
    return SpanCapture()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def telemetry(capture: SpanCapture, registry: CollectorRegistry) -> Telemetry:
    return Telemetry(tracer_provider=capture.provider, metrics=Metrics(registry))
