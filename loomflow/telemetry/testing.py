"""Span and metric capture for tests of your own agents (needs the OpenTelemetry SDK: the
``otel`` extra).

Example:
    >>> capture = SpanCapture()  # doctest: +SKIP
    >>> agent = Agent("...", model=model, runtime=runtime,
    ...               telemetry=Telemetry(tracer_provider=capture.provider, metrics=False))
    >>> await agent.run("hi", session_id="s1", user_id="alice")
    >>> [root] = capture.named("invoke_agent agent")
    >>> [s.name for s in capture.children(root)]
    ['loom.workflow.step']
"""

from __future__ import annotations

from typing import Any

__all__ = ["MetricCapture", "SpanCapture"]


class SpanCapture:
    """An SDK tracer provider that keeps finished spans in memory, with lookup helpers.

    Attributes:
        provider: Give it to ``Telemetry(tracer_provider=...)``.
        exporter: The SDK's ``InMemorySpanExporter`` holding the finished spans.
    """

    def __init__(self) -> None:
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )
        except ImportError as exc:
            raise ImportError(
                "SpanCapture needs the OpenTelemetry SDK: pip install 'loomflow[otel]'"
            ) from exc
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    @property
    def spans(self) -> list[Any]:
        """Every finished span, in the order they ended."""
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[Any]:
        """The finished spans called ``name``."""
        return [s for s in self.spans if s.name == name]

    def children(self, parent: Any) -> list[Any]:
        """The finished spans whose parent is ``parent``, by start time."""
        spans = [
            s
            for s in self.spans
            if s.parent is not None and s.parent.span_id == parent.context.span_id
        ]
        return sorted(spans, key=lambda s: s.start_time or 0)

    def parent_of(self, span: Any) -> Any:
        """The finished parent of ``span``, or ``None`` if it is not among the captured spans."""
        if span.parent is None:
            return None
        return next(
            (s for s in self.spans if s.context.span_id == span.parent.span_id),
            None,
        )

    def clear(self) -> None:
        """Forget the spans captured so far."""
        self.exporter.clear()


class MetricCapture:
    """An SDK meter provider read by an in-memory reader, with lookup helpers.

    Attributes:
        provider: Give it to ``Telemetry(meter_provider=...)`` or ``Metrics(meter_provider=...)``.
        reader: The SDK's ``InMemoryMetricReader``.

    Example:
        >>> capture = MetricCapture()  # doctest: +SKIP
        >>> agent = Agent("...", model=model, telemetry=Telemetry(meter_provider=capture.provider))
        >>> await agent.run("hi", session_id="s1")
        >>> capture.total("gen_ai.client.token.usage", **{"gen_ai.token.type": "input"})
        42.0
    """

    def __init__(self) -> None:
        try:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        except ImportError as exc:
            raise ImportError(
                "MetricCapture needs the OpenTelemetry SDK: pip install 'loomflow[otel]'"
            ) from exc
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])

    def collect(self) -> dict[str, Any]:
        """Every metric recorded so far, by name (the SDK's ``Metric`` objects)."""
        data = self.reader.get_metrics_data()
        if data is None:
            return {}
        return {
            metric.name: metric
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }

    def points(self, name: str, **attributes: Any) -> list[Any]:
        """The data points of metric ``name`` whose attributes include ``attributes``."""
        metric = self.collect().get(name)
        if metric is None:
            return []
        return [
            p
            for p in metric.data.data_points
            if all(p.attributes.get(k) == v for k, v in attributes.items())
        ]

    def total(self, name: str, **attributes: Any) -> float:
        """The sum of a counter's (or gauge's) values, or of a histogram's sums, over the
        matching points."""
        found = 0.0
        for point in self.points(name, **attributes):
            found += point.sum if hasattr(point, "bucket_counts") else point.value
        return found

    def count(self, name: str, **attributes: Any) -> int:
        """How many measurements a histogram holds over the matching points."""
        return sum(int(p.count) for p in self.points(name, **attributes))
