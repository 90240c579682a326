"""OpenTelemetry instruments, built from a table of specs through the OTel meter API.

The library depends on ``opentelemetry-api`` only. With no meter provider given, instruments
come from the global meter provider through the API's proxy meter: every measurement is a no-op
(one attribute check) until the application installs an SDK ``MeterProvider``, and then flows
to it, whenever that happens. The table itself is in ``_metrics`` beside the Prometheus
families it mirrors; this module only turns specs into instruments.
"""

from __future__ import annotations

import importlib.metadata
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry import metrics
from opentelemetry.metrics import MeterProvider

__all__ = ["InstrumentSpec", "Instruments", "instruments_for"]

try:
    _VERSION: str = importlib.metadata.version("loomflow")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    _VERSION = ""


@dataclass(frozen=True)
class InstrumentSpec:
    """One OpenTelemetry instrument: its name, kind, unit, description and (for histograms)
    the bucket boundaries advised to the SDK."""

    name: str
    kind: Literal["counter", "histogram", "gauge"]
    unit: str
    description: str
    buckets: tuple[float, ...] | None = None


class Instruments:
    """The instruments of one meter, by the keys of the spec table they were built from."""

    def __init__(self, meter: metrics.Meter, specs: Mapping[str, InstrumentSpec]) -> None:
        self.by_key: dict[str, Any] = {}
        # The runtimes and audit logs whose entries feed these instruments (once each).
        self.observed: weakref.WeakSet[Any] = weakref.WeakSet()
        self.lock = threading.Lock()
        for key, spec in specs.items():
            if spec.kind == "counter":
                made: Any = meter.create_counter(
                    spec.name, unit=spec.unit, description=spec.description
                )
            elif spec.kind == "histogram":
                made = meter.create_histogram(
                    spec.name,
                    unit=spec.unit,
                    description=spec.description,
                    explicit_bucket_boundaries_advisory=(
                        list(spec.buckets) if spec.buckets is not None else None
                    ),
                )
            else:
                made = meter.create_gauge(spec.name, unit=spec.unit, description=spec.description)
            self.by_key[key] = made

    def add(self, key: str, amount: float, attributes: Mapping[str, str]) -> None:
        self.by_key[key].add(amount, attributes)

    def record(self, key: str, amount: float, attributes: Mapping[str, str]) -> None:
        self.by_key[key].record(amount, attributes)

    def set(self, key: str, amount: float, attributes: Mapping[str, str]) -> None:
        self.by_key[key].set(amount, attributes)


# An SDK meter warns about an instrument created twice under one name, and each Metrics on a
# provider must feed the same instruments: one set per provider (and one for the global one).
_by_provider: weakref.WeakKeyDictionary[MeterProvider, Instruments] = weakref.WeakKeyDictionary()
_global: Instruments | None = None
_lock = threading.Lock()


def instruments_for(
    provider: MeterProvider | None, specs: Mapping[str, InstrumentSpec]
) -> Instruments:
    """The instruments of ``specs`` on ``provider`` (``None``: the global meter provider)."""
    global _global
    with _lock:
        if provider is None:
            if _global is None:
                _global = Instruments(metrics.get_meter("loomflow", _VERSION), specs)
            return _global
        found = _by_provider.get(provider)
        if found is None:
            found = _by_provider[provider] = Instruments(
                metrics.get_meter("loomflow", _VERSION, meter_provider=provider), specs
            )
        return found
