"""A debate's or a workflow's run whose process was SIGKILLed is resumed by a recovery worker,
as an agent's is, when it was built with a name; before, it recorded no agent and stayed
``orphaned`` for good ("the run stored no agent name").

The run starts in a real child process (``_arch_app.py``), blocks inside ``ship``, and the
child is killed; this process recovers it on a real SQLite file or PostgreSQL database. The
ledger says what ran: work finished before the kill is replayed, not done again.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import _arch_app
import pytest
from _fleet import HERE, app_env, cli, kill_when_blocked, tool_counts
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.agent.architectures import Debate, Team, Workflow
from loomflow.errors import UserError
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.recovery import Recovery
from loomflow.runtime import JournalRuntime
from loomflow.telemetry import Metrics
from loomflow.tools import tool


@pytest.fixture
async def registry(
    monkeypatch: pytest.MonkeyPatch, journal_url: str, ledger: Path
) -> AsyncIterator[dict[str, Workflow | Debate]]:
    """The architectures in this process (a recovering worker), closed afterwards."""
    monkeypatch.setenv("FLEET_URL", journal_url)
    monkeypatch.setenv("FLEET_LEDGER", str(ledger))
    monkeypatch.delenv("FLEET_BLOCK", raising=False)
    built = _arch_app.architectures()
    yield built
    runtime = built["pipeline"].runtime
    assert runtime is not None
    await runtime.close()


async def _start_and_kill(url: str, ledger: Path, kind: str, session: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "_arch_app.py"),
        "start",
        kind,
        session,
        env=app_env(url, ledger, FLEET_BLOCK="1"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    await kill_when_blocked(proc, ledger, 1)


def _runtime(built: dict[str, Workflow | Debate]) -> JournalRuntime:
    runtime = built["pipeline"].runtime
    assert runtime is not None
    return runtime


@pytest.mark.parametrize("kind", ["pipeline", "debate"])
async def test_a_killed_run_is_resumed_by_a_worker_and_nothing_runs_twice(
    registry: dict[str, Workflow | Debate], journal_url: str, ledger: Path, kind: str
) -> None:
    session = f"{kind}-1"
    await _start_and_kill(journal_url, ledger, kind, session)
    runtime = _runtime(registry)
    [listed] = await runtime.sessions(state="orphaned")
    assert (listed.session_id, listed.user_id, listed.agent) == (session, "ana", kind)

    metrics = Metrics(CollectorRegistry())
    recovery = Recovery(runtime, registry, metrics=metrics, worker_id="test")
    report = await recovery.sweep()
    assert [r.session_id for r in report.resumed] == [session], report
    await recovery.wait()
    assert {s.session_id: s.state for s in await runtime.sessions()} == {session: "finished"}
    # reserve finished before the kill: replayed. ship was cut off: it runs once, now.
    assert tool_counts(ledger, "reserve") == {session: 1}
    assert tool_counts(ledger, "ship") == {session: 1}
    sample = metrics.registry.get_sample_value
    assert sample("loomflow_recoveries_total", {"outcome": "finished"}) == 1
    # The application's own resume now replays the whole run.
    again = await registry[kind].resume(_arch_app.PROMPT, session_id=session, user_id="ana")
    assert again.fresh_steps == 0
    assert tool_counts(ledger, "ship") == {session: 1}


async def test_a_changed_workflow_is_left_alone(
    registry: dict[str, Workflow | Debate],
    journal_url: str,
    ledger: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _start_and_kill(journal_url, ledger, "pipeline", "wf-1")
    runtime = _runtime(registry)
    monkeypatch.setenv("FLEET_SUMMARY", "Something else.")  # the summary agent's script
    changed = _arch_app.architectures()["pipeline"]
    # Scripts are not configuration; a node added is.
    assert changed.config_fingerprint() == registry["pipeline"].config_fingerprint()
    other = Workflow([*changed.nodes, ("extra", str.upper)], runtime=runtime, name="pipeline")
    report = await Recovery(
        runtime, {"pipeline": other}, metrics=Metrics(CollectorRegistry())
    ).sweep()
    assert report.resumed == []
    [left] = report.unregistered
    assert "another configuration" in (left.reason or "")
    assert tool_counts(ledger, "ship") == {}


async def test_registrations_need_a_name_that_matches(tmp_path: Path) -> None:
    from loomflow.runtime import SqliteRuntime

    runtime = SqliteRuntime(tmp_path / "j.db")
    try:
        unnamed = Workflow([("upper", str.upper)], runtime=runtime)
        with pytest.raises(UserError, match=r"has no name.*name='flow'"):
            Recovery(runtime, {"flow": unnamed})
        named = Workflow([("upper", str.upper)], runtime=runtime, name="other")
        with pytest.raises(UserError, match="is named 'other'"):
            Recovery(runtime, {"flow": named})
        with pytest.raises(UserError, match="Agent, Debate or Workflow"):
            Recovery(runtime, {"flow": object()})  # type: ignore[dict-item]
        # A team is registered through its lead, which the refusal says.
        lead = Agent("l", model=ScriptedModel(["ok"]), runtime=runtime, name="lead")
        team = Team(lead, [Agent("w", model=ScriptedModel(["ok"]), name="w")])
        with pytest.raises(UserError, match=r"register team\.lead as 'lead'"):
            Recovery(runtime, {"lead": team})  # type: ignore[dict-item]
        Recovery(runtime, {"lead": team.lead})
        # A name is checked as ids are.
        with pytest.raises(UserError):
            Workflow([("upper", str.upper)], runtime=runtime, name="bad\nname")
        # Inside an agent's run a named workflow is a sub-run: the outer run's record (the
        # agent's) is the one a recoverer resumes, and the workflow's steps replay with it.
        flow = Workflow([("upper", str.upper)], runtime=runtime, name="flow")

        @tool
        async def shout(text: str) -> str:
            """Shout."""
            return (await flow.run(text)).output

        script = [[ToolCall(id="c", name="shout", arguments={"text": "hi"})], "done"]
        outer = Agent(
            "x",
            model=ScriptedModel(script),
            tools=[shout],
            runtime=runtime,
            telemetry=False,
            memory=False,
            name="outer",
        )
        await outer.run("go", session_id="s", user_id="ana")
        assert [i.agent for i in await runtime.sessions()] == ["outer"]
    finally:
        await runtime.close()


async def test_the_worker_command_serves_a_workflow(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    ledger = tmp_path / "ledger.jsonl"
    await _start_and_kill(url, ledger, "pipeline", "wf-cli")
    env = app_env(url, ledger)
    code, out, err = await cli("worker", "_arch_app:architectures", "--once", "--json", env=env)
    assert code == 0, err
    report = json.loads(out.splitlines()[-1])
    assert [r["session_id"] for r in report["resumed"]] == ["wf-cli"]
    assert tool_counts(ledger, "ship") == {"wf-cli": 1}
    code, out, err = await cli("--url", url, "runs", "list", "--json", env=env)
    assert code == 0, err
    [row] = [json.loads(line) for line in out.splitlines()]
    assert (row["agent"], row["state"]) == ("pipeline", "finished")
