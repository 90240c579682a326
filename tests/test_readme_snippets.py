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
    testing = _block("ScriptedModel(")
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
