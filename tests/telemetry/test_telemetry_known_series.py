"""Series that alerts need exist at 0 before their first event; store failures are counted."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.errors import InvalidArgumentError
from loomflow.governance import Cap
from loomflow.models import FunctionModel
from loomflow.recovery import Recovery
from loomflow.runtime import SqliteRuntime
from loomflow.telemetry import BUDGET_CAPS, KINDS, OUTCOMES, RUN_OUTCOMES, STORES, Metrics


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_the_known_cap_names_are_exactly_those_a_cap_can_have() -> None:
    metrics = ("tokens_in", "tokens_out", "tokens_total", "cost_usd", "wall_clock_s")
    names = {Cap(m, 1.0, scope="run").name for m in metrics}
    for scope, metric, window in itertools.product(
        ("user", "global"), metrics, (None, "day", "month")
    ):
        names.add(Cap(metric, 1.0, scope=scope, window=window).name)  # type: ignore[arg-type]
    assert set(BUDGET_CAPS) == names | {"unavailable"}
    assert len(BUDGET_CAPS) == len(set(BUDGET_CAPS)) == 36


def test_every_budget_cap_and_store_series_exists_at_zero_from_registration() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    for cap in BUDGET_CAPS:
        assert sample(registry, "loomflow_budget_denials_total", cap=cap) == 0.0, cap
    for store in STORES:
        assert sample(registry, "loomflow_store_unavailable_total", store=store) == 0.0


def test_a_first_denial_is_an_increase_of_an_existing_series() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    before = sample(registry, "loomflow_budget_denials_total", cap="global.cost_usd.daily")
    metrics.budget_denied("global.cost_usd.daily")
    after = sample(registry, "loomflow_budget_denials_total", cap="global.cost_usd.daily")
    assert (before, after) == (0.0, 1.0)


def test_an_unavailable_budget_store_counts_as_a_store_failure() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.budget_denied("unavailable")
    metrics.store_unavailable("journal")
    metrics.store_unavailable("journal")
    assert sample(registry, "loomflow_budget_denials_total", cap="unavailable") == 1.0
    assert sample(registry, "loomflow_store_unavailable_total", store="budget") == 1.0
    assert sample(registry, "loomflow_store_unavailable_total", store="journal") == 2.0
    assert sample(registry, "loomflow_store_unavailable_total", store="audit") == 0.0


def test_an_unknown_store_is_refused() -> None:
    # A typed error (still a ValueError, as it was).
    with pytest.raises(InvalidArgumentError, match="store must be one of"):
        Metrics(CollectorRegistry()).store_unavailable("redis")


async def test_a_recoverer_creates_its_journals_step_and_run_series_at_zero(
    tmp_path: Path,
) -> None:
    # A worker resumes runs (replay hits) at its first sweep, before Prometheus first scrapes
    # it: series born then hid those hits from increase() on the replay-ratio panel.
    registry = CollectorRegistry()
    runtime = SqliteRuntime(tmp_path / "journal.db")
    try:
        agent = Agent("x", model=FunctionModel(lambda m, t: "hi"), runtime=runtime, name="a")
        Recovery(runtime, {"a": agent}, metrics=Metrics(registry))
        for kind in KINDS:
            for outcome in OUTCOMES:
                labels = {"backend": "sqlite", "kind": kind, "outcome": outcome}
                assert registry.get_sample_value("loomflow_journal_steps_total", labels) == 0.0
        for outcome in RUN_OUTCOMES:
            labels = {"backend": "sqlite", "outcome": outcome, "resumed": "true"}
            assert registry.get_sample_value("loomflow_runs_total", labels) == 0.0
    finally:
        await runtime.close()
