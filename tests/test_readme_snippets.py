"""The README's Python snippets, run as a new user would: offline, with a scripted model."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime

ROOT = Path(__file__).resolve().parent.parent
PROVIDER = 'model="claude-opus-4-7",'


def _block(containing: str) -> str:
    text = (ROOT / "README.md").read_text()
    (found,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if containing in b]
    return str(found)


def _with_model(code: str, model: str) -> str:
    line = next(ln for ln in code.splitlines() if PROVIDER in ln)  # the one provider model
    return code.replace(line, line[: line.index(PROVIDER)] + f"model={model},")


async def test_quick_start_with_the_scripted_model_of_the_testing_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the snippet journals to ./journal.db
    testing = _block('Refunded $20 on order 42.",  # asked')
    namespace: dict[str, Any] = {}
    # The testing section's model, without its `agent = ...` line (the quick start builds it).
    exec(testing[: testing.index("agent = Agent(")], namespace)
    quick = _with_model(_block("@tool(destructive=True)"), "model")
    exec(quick.replace("asyncio.run(main())", ""), namespace)
    await namespace["main"]()
    assert capsys.readouterr().out.startswith("Refunded $20 on order 42. ")
    assert namespace["model"].calls == 2  # the refund turn, then the answer
    assert (tmp_path / "journal.db").exists()


async def test_checkpoints_and_memory_snippet_runs_as_written(tmp_path: Path) -> None:
    code = _with_model(_block("from_checkpoint="), "MODEL")
    model = ScriptedModel(["Hello Alice.", "You said: Hi, I'm Alice."])
    namespace: dict[str, Any] = {"MODEL": model}
    # Top-level awaits, as in a notebook: run the snippet as the body of a coroutine.
    exec("async def snippet(runtime):\n" + textwrap.indent(code, "    "), namespace)
    async with SqliteRuntime(tmp_path / "journal.db") as runtime:
        await namespace["snippet"](runtime)
    # The second run remembered the first; the resume and the fork restored snapshots.
    assert model.calls == 2
    assert any(m.content == "Hi, I'm Alice." for m in model.requests[1])


def test_structured_output_snippet_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, Any] = {"__name__": "readme_snippet"}
    exec(_block("output_type=Refund"), namespace)  # asyncio.run: this test is not a coroutine
    assert capsys.readouterr().out == "42 20.0 2\n"
    assert namespace["model"].calls == 2  # the refused answer and the retry


async def test_otel_metrics_snippet_runs_as_written() -> None:
    code = _with_model(_block("InMemoryMetricReader"), "MODEL")
    namespace: dict[str, Any] = {"MODEL": ScriptedModel(["Hello."])}
    exec("async def snippet():\n" + textwrap.indent(code, "    "), namespace)
    await namespace["snippet"]()  # its own assert checks the GenAI token metric arrived


async def test_deferred_approvals_snippet_runs_as_written(tmp_path: Path) -> None:
    from loomflow.messages import ToolCall
    from loomflow.tools import tool

    refunded: list[int] = []

    @tool(destructive=True)
    def refund(order: int) -> str:
        """Refund an order."""
        refunded.append(order)
        return f"refunded {order}"

    code = _with_model(_block('approval="defer"'), "MODEL")
    model = ScriptedModel(
        [[ToolCall(id="c1", name="refund", arguments={"order": 42})], "Refunded order 42."]
    )
    namespace: dict[str, Any] = {"MODEL": model, "refund": refund}
    exec("async def snippet(runtime, Agent):\n" + textwrap.indent(code, "    "), namespace)
    from loomflow import Agent

    async with SqliteRuntime(tmp_path / "journal.db") as runtime:
        await namespace["snippet"](runtime, Agent)
    assert refunded == [42]
    assert model.calls == 2  # the first model call was replayed by the resume


async def test_recovery_snippet_resumes_an_orphaned_run(tmp_path: Path) -> None:
    from loomflow.agent import Agent
    from loomflow.runtime import RunRecord

    namespace: dict[str, Any] = {}
    exec(_block("Recovery(runtime"), namespace)
    async with SqliteRuntime(tmp_path / "journal.db") as runtime:
        agent = Agent(
            "x", model=ScriptedModel(["done"]), runtime=runtime, memory=False, name="orders"
        )
        record = RunRecord("orders", agent.config_fingerprint(), {"prompt": "go"})
        # An orphan as a crashed worker leaves it: open, held by an owner whose lease ran out.
        async with runtime.session("s-1", "ana", record=record):
            pass
        await runtime.database.execute(
            "UPDATE loom_sessions SET open = 1, owner = 'x:1:h:u', lease_until = 0"
        )
        report = await namespace["recover_once"](runtime, agent)
        assert [r.session_id for r in report.resumed] == ["s-1"]
        [info] = await runtime.sessions()
        assert info.state == "finished"


def test_journal_your_own_steps_replays_what_a_killed_process_finished(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = _block('runtime.step("charge", charge')
    killed = code.replace(
        """    print(f"receipt {receipt['receipt']} sent")""",
        "    import os\n    os._exit(9)  # the process dies after charge returned",
    )
    assert killed != code

    def run(source: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", source], cwd=tmp_path, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip

    assert run(killed).returncode == 9
    resumed = run(code)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines() == ["receipt r-1 sent", "1 1"]  # not charged again
    again = run(code)  # a finished run: the next one starts afresh
    assert again.stdout.splitlines() == ["charging 59.8 for order-42", "receipt r-1 sent", "0 2"]


def test_governance_snippet_writes_what_the_cli_then_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import subprocess
    import sys

    from loomflow import Agent, ToolCall, tool

    @tool
    def find_customer(name: str) -> str:
        """Find a customer."""
        return "c-1"

    @tool(destructive=True)
    def delete_customer(customer_id: str) -> str:
        """Delete a customer."""
        raise AssertionError("a denied tool ran")

    monkeypatch.chdir(tmp_path)  # the snippet's journal and audit log are ./journal.db
    call = ToolCall(id="c1", name="delete_customer", arguments={"customer_id": "c-1"})
    namespace: dict[str, Any] = {
        "Agent": Agent,
        "find_customer": find_customer,
        "delete_customer": delete_customer,
        "MODEL": ScriptedModel([[call], "I may not delete customers."]),
    }

    async def run() -> None:
        async with SqliteRuntime("./journal.db") as runtime:
            namespace["runtime"] = runtime
            exec(_with_model(_block("SqlBudgetStore(runtime.database)"), "MODEL"), namespace)
            agent = namespace["agent"]
            result = await agent.run("delete c-1", session_id="s-1", user_id="alice")
            assert "permission denied" in result.messages[-2].content
            await agent.audit.close()

    asyncio.run(run())

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "loomflow.cli", "--url", "sqlite:///journal.db", *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "alice" in cli("budget", "show")
    assert "permission.decision" in cli("audit", "query", "--user", "alice")


async def test_a_resume_must_repeat_the_runs_prompt_session_and_user(tmp_path: Path) -> None:
    # README, quick start: a resume without the user id finds no run and repeats the side
    # effect; one with another prompt pays for the model calls again. What the sentence warns
    # of is what the code does (a change here must change the sentence too).
    from loomflow import Agent, ToolCall, Tuning, tool
    from loomflow.errors import UserError

    assert (
        "a resume that leaves\nout `user_id` looks for a run without a user"
        in (ROOT / "README.md").read_text()
    )
    refunds: list[str] = []

    @tool
    async def refund(order_id: str) -> str:
        """Refund an order."""
        refunds.append(order_id)
        return "refunded"

    def model() -> ScriptedModel:
        call = ToolCall(id="c1", name="refund", arguments={"order_id": "42"})
        return ScriptedModel([[call], "Refunded."])

    async with SqliteRuntime(tmp_path / "journal.db") as runtime:
        agent = Agent("x", model=model(), tools=[refund], runtime=runtime, memory=False)
        await agent.run("Refund order 42", session_id="t-42", user_id="alice")
        await agent.clone(model=model()).resume(
            "Refund order 42", session_id="t-42", user_id="alice"
        )
        assert refunds == ["42"]  # the right resume replays the refund
        await agent.clone(model=model()).resume("Refund order 42", session_id="t-42")
        assert refunds == ["42", "42"]  # no user: a new run in the anonymous bucket
        other_prompt = agent.clone(model=model())
        await other_prompt.resume("Refund 42", session_id="t-42", user_id="alice")
        assert other_prompt.model.calls == 2  # another prompt: the model is asked again ...
        assert refunds == ["42", "42"]  # ... and the very same tool call replays

        snapshots = agent.clone(model=model(), tuning=Tuning(checkpoint=True))
        await snapshots.run("Refund order 42", session_id="t-43", user_id="alice")
        with pytest.raises(UserError, match="was taken for the prompt"):
            await snapshots.resume("Refund 42", session_id="t-43", user_id="alice")


async def test_settings_snippets_build_the_agent_and_the_stores_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # README, Settings: `Agent.from_settings` and `Stores()`, run as written (top-level awaits,
    # as in a notebook) with the environment the comment shows, on SQLite files.
    import os

    from loomflow import ToolCall, tool

    @tool(destructive=True)
    async def refund(order_id: str, amount: float) -> str:
        """Refund part of an order."""
        return f"refunded ${amount:.2f} on {order_id}"

    for variable in [v for v in os.environ if v.upper().startswith("LOOMFLOW_")]:
        monkeypatch.delenv(variable)
    monkeypatch.chdir(tmp_path)  # no .env of the caller's
    monkeypatch.setenv("LOOMFLOW_RUNTIME_URL", f"sqlite:///{tmp_path / 'app.db'}")
    monkeypatch.setenv("LOOMFLOW_AUDIT_URL", f"sqlite:///{tmp_path / 'audit.db'}")
    call = ToolCall(id="c1", name="refund", arguments={"order_id": "42", "amount": 20.0})
    namespace: dict[str, Any] = {
        "refund": refund,
        "MODEL": ScriptedModel([[call], "Refunded $20 on order 42."]),
    }
    code = _with_model(_block("async with Agent.from_settings("), "MODEL")
    code += "\n" + _block("async with Stores() as stores:") + "\nreturn document"
    exec("async def snippet():\n" + textwrap.indent(code, "    "), namespace)
    document = await namespace["snippet"]()

    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("journal schema at version")  # report.steps, one a line
    assert any(line.startswith("audit schema at version") for line in printed)
    assert document["user_id"] == "alice"
    assert [s["session_id"] for s in document["journal"]["sessions"]] == ["ticket-42"]
    actions = [entry["action"] for entry in document["audit"]]
    assert actions[0] == "run.start"
    assert actions[-1] == "run.end"
    assert (tmp_path / "audit.db").exists()  # the audit log went where LOOMFLOW_AUDIT_URL says
