"""Agents sharing one runtime: each run's step spans follow the telemetry of the agent running
it (its tracer provider and its user-id option), not the first telemetry on the runtime."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loomflow.agent import Agent
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Metrics, Telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.tools import tool

KEY = "k" * 32
USER_ATTRIBUTES = ("user_id", "user.id")


@tool
def lookup(order: int) -> str:
    """Look an order up."""
    return "shipped"


def script() -> ScriptedModel:
    return ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"order": 7})], "Shipped."])


def attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def hashed(user_id: str) -> str:
    return "h:" + hmac.new(KEY.encode(), user_id.encode(), hashlib.sha256).hexdigest()[:16]


def assert_own_run_only(capture: SpanCapture, agent_name: str, run_id: str) -> list[Any]:
    """The provider holds one run: its root, and its four steps under that root."""
    [root] = capture.named(f"invoke_agent {agent_name}")
    assert attrs(root)["loom.run.id"] == run_id
    steps = capture.named("loom.workflow.step")
    # Model call, tool call, model call, memory episode: no step of the other agent's run.
    assert len(steps) == 4
    assert {attrs(s)["loom.run.id"] for s in steps} == {run_id}
    assert all(capture.parent_of(s) is root for s in steps)
    assert {s.context.trace_id for s in capture.spans} == {root.context.trace_id}
    # The chat and execute_tool spans of the live calls hang from this provider's steps.
    below = [c.name for s in steps for c in capture.children(s)]
    assert sorted(below) == ["chat scripted", "chat scripted", "execute_tool lookup"]
    return [root, *steps]


@pytest.mark.parametrize("mode", ["omit", "hashed"])
@pytest.mark.parametrize("order", ["plain-first", "other-first", "concurrent"])
async def test_agents_sharing_a_runtime_trace_their_steps_with_their_own_telemetry(
    mode: str, order: str
) -> None:
    plain_capture, other_capture = SpanCapture(), SpanCapture()
    runtime = InMemoryRuntime()
    plain = Agent(
        "a", model=script(), tools=[lookup], runtime=runtime, name="plain",
        telemetry=Telemetry(tracer_provider=plain_capture.provider, metrics=False),
    )  # fmt: skip
    other = Agent(
        "b", model=script(), tools=[lookup], runtime=runtime, name="other",
        telemetry=Telemetry(
            tracer_provider=other_capture.provider,
            metrics=False,
            user_ids=mode,  # type: ignore[arg-type]
            user_id_key=KEY,
        ),
    )  # fmt: skip

    def run_plain() -> Any:
        return plain.run("where?", session_id="s-plain", user_id="ana")

    def run_other() -> Any:
        return other.run("where?", session_id="s-other", user_id="bob")

    if order == "plain-first":
        plain_result, other_result = await run_plain(), await run_other()
    elif order == "other-first":
        other_result = await run_other()
        plain_result = await run_plain()
    else:
        plain_result, other_result = await asyncio.gather(run_plain(), run_other())

    for span in assert_own_run_only(plain_capture, "plain", plain_result.run_id):
        assert attrs(span)["user_id"] == attrs(span)["user.id"] == "ana"
    for span in assert_own_run_only(other_capture, "other", other_result.run_id):
        found = attrs(span)
        if mode == "omit":
            assert not set(USER_ATTRIBUTES) & set(found)
            assert "bob" not in json.dumps(found)
        else:
            assert found["user_id"] == found["user.id"] == hashed("bob")
        assert found["session.id"] == "s-other"


@pytest.mark.parametrize("untraced", ["tracing=False", "Metrics"])
async def test_an_untraced_agent_on_a_traced_runtime_gets_no_step_spans(untraced: str) -> None:
    capture = SpanCapture()
    runtime = InMemoryRuntime()
    traced = Agent(
        "a", model=script(), tools=[lookup], runtime=runtime, name="traced",
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False),
    )  # fmt: skip
    quiet: Any = (
        Telemetry(tracer_provider=capture.provider, metrics=False, tracing=False)
        if untraced == "tracing=False"
        else Metrics(otel=False)
    )
    untraced_agent = Agent("b", model=script(), tools=[lookup], runtime=runtime, telemetry=quiet)
    traced_result = await traced.run("where?", session_id="s1", user_id="ana")
    await untraced_agent.run("where?", session_id="s2", user_id="bob")
    steps = capture.named("loom.workflow.step")
    assert {attrs(s)["loom.run.id"] for s in steps} == {traced_result.run_id}
    assert "bob" not in json.dumps([attrs(s) for s in capture.spans])


# The reproduction of the audit: agent A on the default telemetry (global provider, plain user
# ids) and agent B with user_ids="omit" on a provider of its own, one runtime, in either order.
APP = """
import asyncio, json, sys
from opentelemetry import trace
from loomflow.agent import Agent
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.tools import tool

@tool
def lookup(order: int) -> str:
    \"\"\"Look an order up.\"\"\"
    return "shipped"

def script():
    return ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"order": 7})], "Shipped."])

def spans(capture):
    return [
        {"name": s.name, "attributes": dict(s.attributes),
         "parent": s.parent.span_id if s.parent else None, "id": s.context.span_id}
        for s in capture.spans
    ]

async def main(order):
    glob, own = SpanCapture(), SpanCapture()
    trace.set_tracer_provider(glob.provider)
    runtime = InMemoryRuntime()
    a = Agent("a", model=script(), tools=[lookup], runtime=runtime, name="a")  # default
    b = Agent("b", model=script(), tools=[lookup], runtime=runtime, name="b",
              telemetry=Telemetry(tracer_provider=own.provider, metrics=False, user_ids="omit"))
    runs = [(a, "ana"), (b, "bob")]
    for agent, user in runs if order == "default-first" else runs[::-1]:
        await agent.run("where?", session_id=f"s-{agent.name}", user_id=user)
    print(json.dumps({"global": spans(glob), "own": spans(own)}))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("order", ["default-first", "omit-first"])
def test_the_default_telemetry_and_an_omit_agent_on_one_runtime(tmp_path: Path, order: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LOOMFLOW_", "OTEL_"))}
    done = subprocess.run(
        [sys.executable, "-c", APP, order],
        env=clean,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for provider, agent, user in (("global", "a", "ana"), ("own", "b", "bob")):
        spans = found[provider]
        [root] = [s for s in spans if s["name"] == f"invoke_agent {agent}"]
        steps = [s for s in spans if s["name"] == "loom.workflow.step"]
        assert len(steps) == 4
        assert all(s["parent"] == root["id"] for s in steps)
        run_id = root["attributes"]["loom.run.id"]
        assert {s["attributes"]["loom.run.id"] for s in steps} == {run_id}
        for span in (root, *steps):
            if user == "ana":
                assert span["attributes"]["user.id"] == "ana"
            else:
                assert not set(USER_ATTRIBUTES) & set(span["attributes"])
    # B's user id reaches no span, of either provider (session ids are not user ids).
    assert "bob" not in json.dumps(found)


@pytest.mark.parametrize("order", ["traced-first", "concurrent"])
async def test_an_agent_without_telemetry_gets_no_spans_on_a_shared_runtime(order: str) -> None:
    # telemetry=False records nothing at all, as the docs say: its steps were traced by the
    # runtime's first telemetry (another agent's provider), with its user id in plain text.
    capture = SpanCapture()
    runtime = InMemoryRuntime()
    traced = Agent(
        "a", model=script(), tools=[lookup], runtime=runtime, name="traced",
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False),
    )  # fmt: skip
    dark = Agent("b", model=script(), tools=[lookup], runtime=runtime, name="dark", telemetry=False)
    if order == "traced-first":
        mine = await traced.run("go", session_id="s-traced", user_id="ana")
        await dark.run("go", session_id="s-dark", user_id="private-bob")
    else:
        mine, _ = await asyncio.gather(
            traced.run("go", session_id="s-traced", user_id="ana"),
            dark.run("go", session_id="s-dark", user_id="private-bob"),
        )
    assert_own_run_only(capture, "traced", mine.run_id)
    shown = json.dumps([attrs(s) for s in capture.spans])
    assert "private-bob" not in shown
    assert "s-dark" not in shown
    from loomflow.telemetry._hooks import _run_tracing

    assert _run_tracing == {}  # nothing kept once the runs ended
