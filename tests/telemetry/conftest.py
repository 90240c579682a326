"""Fixtures of the telemetry tests: an in-memory span exporter, a private metrics registry and
a real OTLP/HTTP receiver on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _otlp import Received, receiver
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


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[str, Received]]:
    """A real HTTP server on loopback that accepts OTLP/HTTP export requests and keeps them."""
    with receiver() as found:
        yield found
