"""Prometheus metrics: what is counted, on every backend, and that no label is unbounded."""

from __future__ import annotations

import asyncio
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from _telemetry_workload import Expected, run_workload
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from loomflow.agent import Agent
from loomflow.agent.hooks import Interrupt, RunHooks, RunInfo
from loomflow.governance import (
    BudgetDenied,
    BudgetUnavailable,
    GuardrailTripped,
    PermissionDecided,
)
from loomflow.messages import Message, ModelSettings, ToolCall, Usage
from loomflow.models import AnthropicModel, FunctionModel, cost_usd
from loomflow.runtime import InMemoryRuntime, JournalRuntime, SqliteRuntime
from loomflow.telemetry import (
    BUDGET_CAPS,
    ERROR_CLASSES,
    JOURNAL_WRITE_BUCKETS,
    MAX_LABEL_VALUES,
    RUN_OUTCOMES,
    STEP_BUCKETS,
    Metrics,
    Telemetry,
    serve_metrics,
)
from loomflow.testing.providers import FakeAnthropicAPI, Reply
from loomflow.tools import Tool, ToolOutcome, tool

# The audit log's actions (loomflow.audit.actions), as the audit layer reports them.
AUDIT_ACTIONS = (
    "run.start", "run.end", "model.call", "model.replay", "tool.call", "tool.result",
    "tool.replay", "permission.decision", "budget.denied", "budget.warning", "guardrail.trip",
    "replay.divergence",
)  # fmt: skip


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


async def test_replay_outcomes_and_latencies_are_counted_by_kind_and_backend(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]], registry: CollectorRegistry
) -> None:
    runtime = await runtime_factory()
    telemetry = Telemetry(metrics=Metrics(registry), tracing=False)
    expected = await run_workload(runtime, telemetry, users=2, sessions_per_user=5)
    backend = runtime.backend
    for kind in ("model", "tool"):
        hits = value(
            registry, "loomflow_journal_steps_total", backend=backend, kind=kind, outcome="hit"
        )
        misses = value(
            registry, "loomflow_journal_steps_total", backend=backend, kind=kind, outcome="miss"
        )
        assert (hits, misses) == (expected.hits[kind], expected.misses[kind]), kind
        assert (
            value(
                registry,
                "loomflow_step_duration_seconds_count",
                backend=backend,
                kind=kind,
                outcome="miss",
            )
            == expected.misses[kind]
        )
    # Every fresh step wrote one entry; replayed ones wrote none.
    assert value(registry, "loomflow_journal_write_seconds_count", backend=backend) == sum(
        expected.misses.values()
    )
    assert value(registry, "loomflow_journal_write_seconds_sum", backend=backend) > 0
    # Series that never moved exist at 0, so rates and alerts have something to read.
    assert (
        registry.get_sample_value(
            "loomflow_journal_steps_total",
            {"backend": backend, "kind": "memory", "outcome": "divergence"},
        )
        == 0.0
    )


async def test_runs_are_counted_by_outcome_and_resumption(registry: CollectorRegistry) -> None:
    runtime = InMemoryRuntime()
    telemetry = Telemetry(metrics=Metrics(registry), tracing=False)
    await run_workload(runtime, telemetry, users=2, sessions_per_user=5)

    def runs(outcome: str, resumed: str) -> float:
        return value(
            registry, "loomflow_runs_total", backend="memory", outcome=outcome, resumed=resumed
        )

    # Per user: 3 plain runs, 1 run + its resume, 1 failed run + its rerun.
    assert runs("finished", "false") == 2 * 4
    assert runs("finished", "true") == 2 * 2
    assert runs("failed", "false") == 2 * 1
    loop = Agent(
        "x",
        model=FunctionModel(lambda m, t: [ToolCall(id="1", name="nothing", arguments={})]),
        runtime=runtime,
        telemetry=telemetry,
        max_turns=1,
    )
    result = await loop.run("go", session_id="looping")
    assert result.interruption_reason == "max_turns"
    assert runs("interrupted", "false") == 1


async def test_live_tokens_and_cost_are_counted_by_model_and_replays_are_free(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    @tool
    def lookup(order: int) -> str:
        """Look an order up."""
        return "shipped"

    script = (
        Reply(tool_calls=[ToolCall(id="t1", name="lookup", arguments={"order": 7})]),
        Reply(text="Shipped.", input_tokens=40, output_tokens=9),
    )
    runtime = SqliteRuntime(tmp_path / "journal.db")
    with FakeAnthropicAPI(*script) as api:
        model = AnthropicModel("claude-opus-4-7", base_url=api.base_url, api_key="test")
        agent = Agent(
            "x",
            model=model,
            tools=[lookup],
            runtime=runtime,
            telemetry=Telemetry(metrics=Metrics(registry), tracing=False),
        )
        try:
            first = await agent.run("where?", session_id="s", user_id="u")
            await agent.resume("where?", session_id="s", user_id="u")
        finally:
            await model.aclose()
            await runtime.close()
    labels = {"provider": "anthropic", "model": "claude-opus-4-7"}
    assert value(registry, "loomflow_model_tokens_total", **labels, type="input") == 12 + 40
    assert value(registry, "loomflow_model_tokens_total", **labels, type="output") == 7 + 9
    expected_cost = cost_usd("claude-opus-4-7", Usage(input_tokens=52, output_tokens=16))
    assert expected_cost is not None
    assert expected_cost > 0
    assert value(registry, "loomflow_model_cost_usd_total", **labels) == pytest.approx(
        expected_cost
    )
    assert first.cost_usd == pytest.approx(expected_cost)


class Governor(RunHooks):
    """Stands in for governance: emits its events, and denies every model call of some users."""

    def __init__(self, deny_users: set[str]) -> None:
        self.deny_users = deny_users

    async def check_input(self, info: RunInfo, prompt: str) -> str:
        if "secret" in prompt:
            info.emit(GuardrailTripped(name="pii", stage="input", action="redact"))
            return prompt.replace("secret", "[redacted]")
        return prompt

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        if info.user_id in self.deny_users and turn == 1:
            info.emit(BudgetDenied(cap="user.tokens_total", limit=100, used=90, requested=20))
            raise Interrupt("budget:user.tokens_total")
        return None

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        info.emit(
            PermissionDecided(
                tool=call.name,
                turn=turn,
                slot=slot,
                decision="ask",
                final="allow",
                reason="approved",
                policy="default",
            )
        )
        return call


async def test_governance_events_and_audit_entries_are_counted(
    registry: CollectorRegistry,
) -> None:
    metrics = Metrics(registry)
    telemetry = Telemetry(metrics=metrics, tracing=False)
    await run_workload(
        InMemoryRuntime(),
        telemetry,
        users=2,
        sessions_per_user=3,
        hooks=[Governor(deny_users={"user-0001"})],
    )
    assert value(registry, "loomflow_budget_denials_total", cap="user.tokens_total") == 3
    # Every live tool call had a decision; user-0001's runs stopped before their tool results
    # mattered, but their tool calls (turn 0) still ran.
    assert (
        value(registry, "loomflow_permission_decisions_total", decision="ask", final="allow") == 6
    )
    assert (
        value(registry, "loomflow_permission_decisions_total", decision="deny", final="deny") == 0
    )
    assert (
        value(
            registry,
            "loomflow_runs_total",
            backend="memory",
            outcome="interrupted",
            resumed="false",
        )
        == 3
    )

    class Emitting(RunHooks):
        async def run_started(self, info: RunInfo) -> None:
            info.emit(BudgetUnavailable(detail="store down"))

    agent = Agent(
        "x",
        model=FunctionModel(lambda m, t: "ok"),
        telemetry=telemetry,
        hooks=[Governor(set()), Emitting()],
    )
    await agent.run("a secret prompt")
    assert value(registry, "loomflow_guardrail_trips_total", stage="input", action="redact") == 1
    assert value(registry, "loomflow_budget_denials_total", cap="unavailable") == 1

    for action in AUDIT_ACTIONS:
        metrics.audit_entry(action)
    metrics.audit_entry("tool.call")
    assert value(registry, "loomflow_audit_entries_total", action="tool.call") == 2
    assert value(registry, "loomflow_audit_entries_total", action="run.start") == 1


async def test_an_agents_audit_entries_are_counted(registry: CollectorRegistry) -> None:
    from loomflow.audit import AuditLog, InMemoryAuditStore

    audit = AuditLog(InMemoryAuditStore())
    telemetry = Telemetry(metrics=Metrics(registry), tracing=False)
    # Two agents on one audit log and one registry count each entry once.
    agents = [
        Agent("x", model=FunctionModel(lambda m, t: "ok"), audit=audit, telemetry=telemetry)
        for _ in range(2)
    ]
    await agents[0].run("hi", user_id="u")
    await agents[1].run("hi", user_id="u")
    await audit.record("note.custom", user_id="u", actor="ops")
    written = [e.action for e in (await audit.query(user_id="u", limit=1000)).entries]
    assert written.count("run.start") == 2
    for action in set(written):
        assert value(registry, "loomflow_audit_entries_total", action=action) == written.count(
            action
        )
    # An audit log used without an agent is counted once asked.
    other = AuditLog(InMemoryAuditStore())
    Metrics(registry).count_audit(other)
    await other.record("note.custom", user_id="v", actor="ops")
    assert value(registry, "loomflow_audit_entries_total", action="note.custom") == 2


async def test_metrics_alone_plug_into_an_agent(registry: CollectorRegistry) -> None:
    agent = Agent(
        "x",
        model=FunctionModel(lambda m, t: "hi"),
        runtime=InMemoryRuntime(),
        telemetry=Metrics(registry),
    )
    await agent.run("hello", session_id="s")
    assert (
        value(
            registry, "loomflow_runs_total", backend="memory", outcome="finished", resumed="false"
        )
        == 1
    )
    assert (
        value(
            registry, "loomflow_journal_steps_total", backend="memory", kind="model", outcome="miss"
        )
        == 1
    )


def test_metrics_on_one_registry_share_their_series() -> None:
    first = Metrics()
    second = Metrics(REGISTRY)
    before = value(REGISTRY, "loomflow_audit_entries_total", action="run.end")
    first.audit_entry("run.end")
    second.audit_entry("run.end")
    assert value(REGISTRY, "loomflow_audit_entries_total", action="run.end") == before + 2
    Telemetry()  # the default: metrics on the default registry, no duplicate registration


def test_configuration_driven_labels_are_capped(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry)
    for n in range(MAX_LABEL_VALUES + 25):
        metrics.budget_denied(f"cap-{n}")
    caps = {s.labels["cap"] for f in registry.collect() for s in f.samples if "cap" in s.labels}
    # The cap names a Cap can have exist from the start and take no place under the limit.
    assert len(caps - set(BUDGET_CAPS)) == MAX_LABEL_VALUES + 1
    assert "other" in caps
    assert value(registry, "loomflow_budget_denials_total", cap="other") == 25
    metrics.audit_entry("x" * 500)
    assert value(registry, "loomflow_audit_entries_total", action="x" * 64) == 1


def test_model_names_past_the_label_cap_do_not_grow_memory(registry: CollectorRegistry) -> None:
    # prepare_model remembered every raw model name it was given, so a caller passing
    # unbounded names grew the process without limit though the labels stop at the cap.
    metrics = Metrics(registry)
    for n in range(MAX_LABEL_VALUES + 5):  # fill the cap: the rest is "other"
        metrics.prepare_model("openai", f"model-{n}")
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for n in range(20_000):
            metrics.prepare_model("openai", f"tenant-{n:08d}-fine-tune-{n}")
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 100_000  # remembering them held over 2 MB
    assert ("openai", "other") in {
        (s.labels["provider"], s.labels["model"])
        for f in registry.collect()
        if f.name == "loomflow_model_errors"
        for s in f.samples
    }


def test_each_metric_has_its_own_action_label_budget(registry: CollectorRegistry) -> None:
    # The application's audit actions used to use up the places of the guardrail's two
    # actions: a trip was counted as action="other".
    metrics = Metrics(registry)
    for n in range(MAX_LABEL_VALUES + 10):
        metrics.audit_entry(f"app.action-{n}")
    metrics.audit_entry("run.end")  # loomflow's own actions take no place
    metrics.guardrail_tripped("output", "block")
    assert value(registry, "loomflow_guardrail_trips_total", stage="output", action="block") == 1
    assert value(registry, "loomflow_audit_entries_total", action="run.end") == 1
    actions = {
        s.labels["action"]
        for f in registry.collect()
        if f.name == "loomflow_audit_entries"
        for s in f.samples
    }
    assert len(actions - {"run.end", "other"}) == MAX_LABEL_VALUES
    assert value(registry, "loomflow_audit_entries_total", action="other") == 10


def test_a_run_outcome_outside_the_known_set_is_refused(registry: CollectorRegistry) -> None:
    with pytest.raises(ValueError, match="run outcome"):
        Metrics(registry).run_finished(backend="memory", outcome="exploded", resumed=False)


def test_the_metrics_endpoint_serves_the_registry_and_stops(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry)
    metrics.audit_entry("run.start")
    with serve_metrics(0, registry=registry) as server:
        assert server.port > 0
        with urllib.request.urlopen(server.url, timeout=10) as response:
            body = response.read().decode()
        assert response.status == 200
        assert 'loomflow_audit_entries_total{action="run.start"} 1.0' in body
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)


def test_a_port_in_use_is_a_configuration_error_naming_it(registry: CollectorRegistry) -> None:
    # It was the OSError of the bind, naming neither the port nor what failed.
    from loomflow.errors import ConfigurationError

    with serve_metrics(0, registry=registry) as taken:
        port = taken.port
        with pytest.raises(ConfigurationError, match=rf"127\.0\.0\.1:{port}: "):
            serve_metrics(port, registry=registry)


# -- the label test ------------------------------------------------------------------------

FORBIDDEN_LABELS = {"user_id", "user", "session_id", "session", "run_id", "run"}
MAX_VALUES = 16  # a "small bounded number": the widest label here is the audit action (12)


async def test_no_label_is_per_user_or_unbounded_under_a_many_user_workload(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    metrics = Metrics(registry)
    telemetry = Telemetry(metrics=metrics, tracing=False)
    governor = Governor(deny_users={f"user-{n:04d}" for n in range(0, 40, 7)})
    expected = await run_workload(
        InMemoryRuntime(), telemetry, users=40, sessions_per_user=5, hooks=[governor]
    )
    sqlite = SqliteRuntime(tmp_path / "journal.db")
    try:
        more = await run_workload(sqlite, telemetry, users=2, sessions_per_user=5, hooks=[governor])
    finally:
        await sqlite.close()
    for action in AUDIT_ACTIONS:
        metrics.audit_entry(action)
    # Tool errors too: a tool that fails for every one of a few users.
    failing = Agent(
        "x",
        model=FunctionModel(_call_broken_then_answer),
        tools=[broken],
        telemetry=telemetry,
        memory=False,
    )
    for n in range(3):
        result = await failing.run("go", session_id=f"session-broken-{n}", user_id=f"user-b{n}")
        more.users.append(f"user-b{n}")
        more.sessions.append(f"session-broken-{n}")
        more.run_ids.append(result.run_id)
    identities = _identities(expected, more)
    assert len(identities) > 400

    values: dict[tuple[str, str], set[str]] = {}
    samples = 0
    for family in registry.collect():
        for sample in family.samples:
            samples += 1
            assert not FORBIDDEN_LABELS & set(sample.labels), (sample.name, sample.labels)
            for label, label_value in sample.labels.items():
                assert label_value not in identities, (sample.name, label, label_value)
                values.setdefault((family.name, label), set()).add(label_value)
    assert samples > 100
    for (name, label), seen in values.items():
        if label == "le":  # histogram buckets: fixed by the bucket layout
            assert len(seen) <= max(len(STEP_BUCKETS), len(JOURNAL_WRITE_BUCKETS)) + 1
        elif label == "cap":  # the names a Cap can have, all created at 0 up front
            assert seen <= set(BUDGET_CAPS), (name, sorted(seen - set(BUDGET_CAPS)))
        else:
            assert len(seen) <= MAX_VALUES, (name, label, sorted(seen))
    # The run mix reached the labels that matter...
    assert {"memory", "sqlite"} <= values[("loomflow_journal_steps", "backend")]
    assert values[("loomflow_runs", "outcome")] == {
        "finished",
        "interrupted",
        "failed",
        "cancelled",
        "claim_lost",  # created at 0 with the backend's series
    }
    # The error and duration families are in the sweep above, with samples.
    assert "other" in values[("loomflow_model_errors", "error")]  # the workload's ProviderDown
    assert values[("loomflow_model_retries", "error")] == set(ERROR_CLASSES)  # created at 0
    assert values[("loomflow_tool_errors", "tool")] == {"broken"}
    assert values[("loomflow_run_duration_seconds", "outcome")] == set(RUN_OUTCOMES)
    assert (
        value(registry, "loomflow_tool_errors_total", tool="broken", error_type="tool_error") == 3
    )
    # ...and no identity reached the exposition text either.
    text = generate_latest(registry).decode()
    assert "user-00" not in text
    assert "session-" not in text


@tool
def broken(item: str) -> str:
    """Always fails."""
    raise RuntimeError(f"{item} is unavailable")


def _call_broken_then_answer(messages: list[Message], tools: list[Any]) -> Any:
    if messages[-1].role == "tool":
        return "sorry"
    return [ToolCall(id="b1", name="broken", arguments={"item": "x"})]


def _identities(*workloads: Expected) -> set[str]:
    found: set[str] = set()
    for w in workloads:
        found.update(w.users, w.sessions, w.run_ids)
    return found


def test_a_cost_that_is_no_finite_amount_is_not_counted() -> None:
    """A NaN from a custom price table would turn the cost counter into NaN for good."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for bad in (float("nan"), float("inf"), -1.0):
        metrics.model_usage(
            provider="anthropic", model="m", input_tokens=1, output_tokens=1, cost_usd=bad
        )
    metrics.model_usage(
        provider="anthropic", model="m", input_tokens=1, output_tokens=1, cost_usd=0.25
    )
    value = registry.get_sample_value(
        "loomflow_model_cost_usd_total", {"provider": "anthropic", "model": "m"}
    )
    assert value == 0.25
    tokens = registry.get_sample_value(
        "loomflow_model_tokens_total", {"provider": "anthropic", "model": "m", "type": "input"}
    )
    assert tokens == 4  # the tokens of every call still count


async def test_a_label_value_that_utf8_cannot_encode_does_not_break_the_scrape(
    registry: CollectorRegistry,
) -> None:
    # A model name read from bytes that are not UTF-8 (os.environ decodes them with
    # surrogateescape) holds a lone surrogate: encoding it failed every later scrape, so one
    # bad name hid every metric of the process.
    model = "gpt-\udcff"
    agent = Agent(
        "x",
        model=FunctionModel(lambda messages, tools: "done", name=model),
        runtime=InMemoryRuntime(),
        telemetry=Metrics(registry),
    )
    await agent.run("q", session_id="s1", user_id="u1")

    def scrape(url: str) -> tuple[int, str]:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()

    with serve_metrics(0, registry=registry) as server:
        status, body = await asyncio.to_thread(scrape, server.url)
    assert status == 200
    assert 'loomflow_runs_total{backend="memory",outcome="finished",resumed="false"} 1.0' in body
    assert 'model="gpt-\\\\udcff"' in body


def test_the_metrics_endpoint_answers_head_as_get_without_the_body(
    registry: CollectorRegistry,
) -> None:
    # Probes and load balancers often check with HEAD; prometheus-client's server said 405.
    Metrics(registry).audit_entry("run.start")
    with serve_metrics(0, registry=registry) as server:
        head = urllib.request.Request(server.url, method="HEAD")
        with urllib.request.urlopen(head, timeout=10) as response:
            status, length, body = (
                response.status,
                response.headers["Content-Length"],
                response.read(),
            )
        with urllib.request.urlopen(server.url, timeout=10) as response:
            full = response.read()
    assert (status, body) == (200, b"")
    assert length == str(len(full))
