"""What a new user meets following docs/*.md: snippets run as written, tables that match the code,
and command-line messages that say what the docs say they say."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from loomflow import Agent
from loomflow.cli.main import main as cli_main
from loomflow.models import ScriptedModel
from loomflow.telemetry import Metrics
from loomflow.telemetry._metrics import OTEL_INSTRUMENTS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _blocks(page: str, language: str) -> list[str]:
    text = (DOCS / page).read_text()
    return [textwrap.dedent(b) for b in re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)]


def _block(page: str, language: str, containing: str) -> str:
    (found,) = [b for b in _blocks(page, language) if containing in b]
    return found


def _metrics_table() -> list[list[str]]:
    """The rows of docs/telemetry.md's metrics table (Prometheus, OTel, type, labels)."""
    text = (DOCS / "telemetry.md").read_text()
    section = text[text.index("## Metrics") :]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `loomflow_") or line.startswith("| — |"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_every_metric_is_in_the_telemetry_table_once_with_its_otel_twin() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    exported = {family.name for family in registry.collect()}  # counters without _total
    rows = _metrics_table()
    # Every row is a row of the one table with a header: four cells, no leftover fragments.
    assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
    documented = [row[0].strip("`").removesuffix("_total") for row in rows]
    assert len(documented) == len(set(documented)), "a metric is documented twice"
    assert set(documented) == exported
    otel = {row[1].split("`")[1] for row in rows}
    ours = {spec.name for spec in OTEL_INSTRUMENTS.values() if spec.name.startswith("loomflow.")}
    assert ours <= otel


async def test_span_capture_snippet_runs_as_written() -> None:
    code = _block("telemetry.md", "python", "SpanCapture()")
    code = code.replace("...,", '"You answer.", model=ScriptedModel(["hi"]),')
    namespace: dict[str, Any] = {"Agent": Agent, "ScriptedModel": ScriptedModel}
    exec("async def snippet():\n" + textwrap.indent(code, "    "), namespace)
    await namespace["snippet"]()


def test_function_model_is_documented_with_the_arguments_it_is_called_with() -> None:
    text = (DOCS / "concepts" / "agents.md").read_text()
    assert "`fn(messages, tools)`" in " ".join(text.split())


def _require_jq() -> None:
    if shutil.which("jq") is not None:
        return
    message = "jq is not on PATH (the block pipes into it; apt-get install jq)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}; CI must install it")  # .ci/run does: skipping hides the block
    pytest.skip(message)


def test_audit_cli_block_reads_the_audit_log_the_page_writes(tmp_path: Path) -> None:
    _require_jq()
    turning_on = _block("audit.md", "python", 'AuditLog(\n    "sqlite:///audit.db"')
    turning_on = turning_on.replace('model="claude-opus-4-7"', 'model=ScriptedModel(["done"])')
    turning_on = turning_on.replace("tools=[lookup_order, refund]", "tools=[]")
    namespace: dict[str, Any] = {"ScriptedModel": ScriptedModel}
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        # The snippet as written, then what a program does at its end: close what it opened.
        ending = "\nawait agent.runtime.close()\nawait audit.close()\n"
        exec("async def snippet():\n" + textwrap.indent(turning_on + ending, "    "), namespace)
        asyncio.run(namespace["snippet"]())
    finally:
        os.chdir(cwd)
    shell = _block("audit.md", "bash", "loomflow audit --audit-url sqlite:///audit.db query")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "loomflow").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m loomflow.cli "$@"\n')
    (bin_dir / "loomflow").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["LOOMFLOW_RUNTIME_URL"] = "sqlite:///journal.db"
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", shell],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert '"run.end"' in done.stdout  # the jq line read the session's entries
    assert "OK: checked" in done.stdout
    assert (tmp_path / "alice.jsonl").exists()


@pytest.mark.parametrize("age", ["0", "0d", "0s"])
def test_journal_prune_with_a_zero_age_points_to_all(
    age: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--url", "sqlite:///nowhere.db", "journal", "prune", "--older-than", age])
    assert exit_info.value.code == 2  # bad usage, caught before any store is opened
    err = capsys.readouterr().err
    assert "is no age" in err
    assert "--all prunes every finished run" in err


def test_other_zero_ages_stay_plain_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["audit", "retain", "--older-than", "0", "--yes"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "is no age" in err
    assert "--all" not in err  # audit retain has no --all


def _names(code: str) -> tuple[set[str], set[str]]:
    """(names a snippet binds or imports, names it reads); top-level awaits are allowed."""
    import ast

    tree = ast.parse("async def _snippet():\n" + textwrap.indent(code, "    "))
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
    return bound, read


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))]
)
def test_a_page_imports_every_loomflow_name_its_snippets_use(page: str) -> None:
    # A snippet may lean on an earlier one of its page (an `agent` built above), but a
    # loomflow class or function must be imported somewhere on the page: a reader copying
    # `checkpoint_store_for(runtime)` should not have to hunt for its module.
    import importlib

    import loomflow

    modules = ["runtime", "models", "governance", "audit", "telemetry", "checkpoints"]
    modules += ["memory", "recovery", "tools", "errors", "config", "stores"]
    home: dict[str, str] = {}
    for module in modules:
        for name in importlib.import_module(f"loomflow.{module}").__all__:
            home.setdefault(name, f"loomflow.{module}")
    text = (ROOT / page).read_text()
    bound: set[str] = set()
    read: set[str] = set()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        names = _names(textwrap.dedent(block))
        bound |= names[0]
        read |= names[1]
    unimported = {n: home[n] for n in sorted(read - bound - set(loomflow.__all__)) if n in home}
    assert not unimported, f"{page} uses these without importing them: {unimported}"


def test_sqlite_backup_lines_copy_a_journal_that_workers_keep_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # docs/operations/sqlite.md: the Python backup line, taken while a runtime holds the file
    # open in WAL mode, gives a copy the command line reads whole.
    from loomflow.audit import AuditLog
    from loomflow.runtime import SqliteRuntime

    python = next(
        line.strip().strip("`")
        for line in (DOCS / "operations" / "sqlite.md").read_text().splitlines()
        if line.startswith("From Python, `sqlite3.connect(")
    )
    python = python.removeprefix("From Python, `").split("`")[0]

    async def write_then_backup() -> None:
        runtime = SqliteRuntime(tmp_path / "journal.db")
        audit = AuditLog("sqlite:///journal.db")
        agent = Agent("x", model=ScriptedModel(["done"]), runtime=runtime, audit=audit)
        try:
            await agent.run("hi", session_id="s-1", user_id="alice")
            assert (tmp_path / "journal.db-wal").exists()  # still open: commits sit in the WAL
            exec(f"import sqlite3\n{python}", {})
        finally:
            await runtime.close()
            await audit.close()

    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        asyncio.run(write_then_backup())
        capsys.readouterr()
        assert cli_main(["--url", "sqlite:///journal-backup.db", "runs", "list", "--json"]) == 0
        assert '"session_id": "s-1"' in capsys.readouterr().out
        assert cli_main(["--url", "sqlite:///journal-backup.db", "audit", "verify"]) == 0
        assert "OK: checked" in capsys.readouterr().out
    finally:
        os.chdir(cwd)


def _provider_free(code: str, model: str) -> str:
    """A snippet with its provider model id swapped for a scripted model built by the test."""
    assert code.count('model="claude-opus-4-7"') == 1
    return code.replace('model="claude-opus-4-7"', f"model={model}")


async def test_structured_output_snippets_run_as_written() -> None:
    # docs/structured-output.md: the first example with a scripted answer, then the testing
    # example against the local Anthropic wire-format server, as the page shows them.
    first = _provider_free(_block("structured-output.md", "python", "class Invoice"), "MODEL")
    answer = '{"vendor": "ACME", "items": 3, "total_eur": 59}'
    namespace: dict[str, Any] = {"MODEL": ScriptedModel([answer])}
    exec("async def snippet():\n" + textwrap.indent(first + "\nreturn invoice", "    "), namespace)
    invoice = await namespace["snippet"]()
    assert (invoice.vendor, invoice.items, invoice.total_eur) == ("ACME", 3, 59.0)

    testing = _block("structured-output.md", "python", "FakeAnthropicAPI(")
    weather = textwrap.dedent("""
        from pydantic import BaseModel

        class Weather(BaseModel):
            city: str
            celsius: int
        """)
    namespace = {
        "agent": Agent("x", model=ScriptedModel([])),
        "ANSWER": {"city": "Oslo", "celsius": 4},
    }
    exec(weather, namespace)
    exec("async def snippet():\n" + textwrap.indent(testing + "\nreturn result", "    "), namespace)
    assert (await namespace["snippet"]()).parsed.celsius == 4


async def test_memory_snippets_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/memory.md: the default memory, its episodes, facts and blocks, in the page's order.
    monkeypatch.chdir(tmp_path)  # the first snippet journals to ./journal.db
    model = ScriptedModel(["Hello Alice.", "You said you're Alice."])
    code = _provider_free(_block("memory.md", "python", "What did I just say?"), "MODEL")
    for marker in ("memory.episodes(", "memory.remember(", "memory.set_block("):
        code += "\n" + _block("memory.md", "python", marker)
    code += "\nawait agent.runtime.close()\nreturn paris"
    namespace: dict[str, Any] = {"MODEL": model}
    exec("async def snippet():\n" + textwrap.indent(code, "    "), namespace)
    paris = await namespace["snippet"]()
    # The second run was sent the first run's turns, as the page's comment says.
    assert [m.content for m in model.requests[1][1:3]] == ["Hi, I'm Alice.", "Hello Alice."]
    assert paris.object == "Paris"


async def test_checkpoint_snippets_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/checkpoints.md: the run and its resume, listing and forking, export and erasure.
    from loomflow import ToolCall, tool
    from loomflow.models import FunctionModel

    @tool
    def fetch_invoice(number: str) -> str:
        """Fetch an invoice."""
        return f"invoice {number}: 120 EUR"

    @tool
    def post_correction(number: str) -> str:
        """Post a correction."""
        return "posted"

    def reconcile(messages: list[Any], tools: list[Any]) -> Any:
        turn = sum(1 for m in messages if m.role == "assistant")
        if turn < 2:
            return [ToolCall(id=f"c{turn}", name="fetch_invoice", arguments={"number": str(turn)})]
        return "reconciled"

    monkeypatch.chdir(tmp_path)  # the snippet journals to ./journal.db
    code = _provider_free(_block("checkpoints.md", "python", "checkpoint_retention=10"), "MODEL")
    code += "\n" + _block("checkpoints.md", "python", "fork_session_id=")
    code += "\nruntime = agent.runtime\n" + _block("checkpoints.md", "python", "export_user(")
    code += "\nawait runtime.close()\nreturn result, fork, document, deleted"
    namespace: dict[str, Any] = {
        "MODEL": FunctionModel(reconcile),
        "fetch_invoice": fetch_invoice,
        "post_correction": post_correction,
    }
    exec("async def snippet():\n" + textwrap.indent(code, "    "), namespace)
    result, fork, document, deleted = await namespace["snippet"]()
    assert result.restored_from is not None  # the finished run's last snapshot
    assert result.output == "reconciled"
    assert fork.session_id == "inv-2026-03-retry"
    assert document["user_id"] == "acct-7"
    assert document["checkpoints"]
    assert deleted == len(document["checkpoints"])


async def test_approvals_snippets_run_as_written(tmp_path: Path) -> None:
    # docs/approvals.md: a run stops at three refunds, lists them, and a resume decides them
    # (one as asked, one edited, one denied); then the page's two endpoints do it over again.
    from loomflow import ToolCall, tool
    from loomflow.runtime import SqliteRuntime

    refunded: list[tuple[int, int]] = []

    @tool(destructive=True)
    def refund(order: int, cents: int) -> str:
        """Refund part of an order."""
        refunded.append((order, cents))
        return "refunded"

    def refunds() -> ScriptedModel:
        calls = [
            ToolCall(id=f"c{n}", name="refund", arguments={"order": order, "cents": cents})
            for n, (order, cents) in enumerate([(42, 5000), (43, 900), (44, 99_000)])
        ]
        return ScriptedModel([calls, "Done."])

    page = [
        _block("approvals.md", "python", marker)
        for marker in ('approval="defer")', "print(request.")
    ]
    page += [_block("approvals.md", "python", "waiting = await")]
    page += ["first, second, third = waiting", _block("approvals.md", "python", "third.request_id")]
    code = "\n".join(page) + "\nreturn result, permissions"
    async with SqliteRuntime(tmp_path / "journal.db") as runtime:

        def agent_with(permissions: Any) -> Agent:
            return Agent(
                "x", model=refunds(), tools=[refund], runtime=runtime, permissions=permissions
            )

        namespace: dict[str, Any] = {"agent_with": agent_with}
        body = code.replace(
            'approval="defer")', 'approval="defer")\nagent = agent_with(permissions)', 1
        )
        exec("async def snippet():\n" + textwrap.indent(body, "    "), namespace)
        result, permissions = await namespace["snippet"]()
        assert result.output == "Done."
        assert refunded == [(42, 5000), (42, 2500)]  # the third was denied

        server = {"agent": agent_with(permissions)}
        exec(_block("approvals.md", "python", "async def post_task("), server)
        task = {"prompt": "Refund order 42.", "session": "t-8", "user": "ana"}
        status, reply = await server["post_task"](task)
        assert status == 202
        assert len(reply["approvals"]) == 3
        decisions = {r["request_id"]: {"allow": True} for r in reply["approvals"]}
        status, reply = await server["post_approvals"]({**task, "decisions": decisions}, "kim")
        assert (status, reply) == (200, {"status": "done", "output": "Done."})
        assert refunded[2:] == [(42, 5000), (43, 900), (44, 99_000)]
        status, reply = await server["post_approvals"]({**task, "decisions": decisions}, "kim")
        assert status == 409  # decided already


async def test_audit_api_snippets_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # docs/audit.md, in the page's order: turn it on, record, query/export/verify, then the
    # erasure, hold and retention of `Stores()` (the settings name the page's two files), and
    # the testing example.
    from datetime import datetime

    from loomflow import ToolCall, tool

    @tool
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        return "paid"

    @tool(destructive=True)
    def refund(order_id: str) -> str:
        """Refund an order."""
        return "refunded"

    for variable in [v for v in os.environ if v.upper().startswith("LOOMFLOW_")]:
        monkeypatch.delenv(variable)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOMFLOW_RUNTIME_URL", "sqlite:///journal.db")
    monkeypatch.setenv("LOOMFLOW_AUDIT_URL", "sqlite:///audit.db")

    def refunding() -> ScriptedModel:
        call = ToolCall(id="c1", name="refund", arguments={"order_id": "1042"})
        return ScriptedModel([[call], "Refunded."])

    turning_on = _block("audit.md", "python", 'AuditLog(\n    "sqlite:///audit.db"')
    code = _provider_free(turning_on, "MODEL")
    for marker in ("await audit.record(", "page = await audit.query(", "stores.forget_user("):
        code += "\n" + _block("audit.md", "python", marker)
    code += "\nawait agent.runtime.close()\nawait audit.close()"  # the program is done with them
    testing = _block("audit.md", "python", "InMemoryAuditStore()")
    code += "\n" + testing.replace("ScriptedModel([...])", "refunding()")
    namespace: dict[str, Any] = {
        "MODEL": refunding(),
        "datetime": datetime,
        "lookup_order": lookup_order,
        "refund": refund,
        "refunding": refunding,
    }
    exec("async def snippet():\n" + textwrap.indent(code, "    "), namespace)
    await namespace["snippet"]()

    printed = capsys.readouterr().out
    assert " tool.call {" in printed  # the query's page: seq, time, action, payload
    assert "'journal': " in printed  # forget_user's counts
    # The export, made before the erasure: alice's whole trail, the recorded approval last.
    trail = [json.loads(line) for line in (tmp_path / "alice.jsonl").read_text().splitlines()]
    actions = [e["action"] for e in trail[1:]]
    assert actions[0] == "run.start"
    assert actions[-2:] == ["run.end", "approval.granted"]
    assert trail[-1]["payload"] == {"ticket": "T-77"}


@pytest.mark.postgres
async def test_governance_snippets_run_as_written(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # docs/governance.md on a real PostgreSQL: the approval handler, the agent (its DSN swapped
    # for the test database), its budget status and a permission check, the rule and guardrail
    # examples, and the budget stores.
    from types import SimpleNamespace

    from loomflow import ToolCall, tool

    @tool
    def find_customer(name: str) -> str:
        """Find a customer."""
        return "c-1"

    @tool
    def update_customer(customer_id: str, email: str) -> str:
        """Update a customer's e-mail."""
        return "updated"

    @tool(destructive=True)
    def delete_customer(customer_id: str) -> str:
        """Delete a customer."""
        raise AssertionError("the deny rule let a VIP deletion through")

    class Ticketing:  # the page's ticketing system: the reviewer says yes
        async def ask(self, *question: Any) -> SimpleNamespace:
            return SimpleNamespace(
                approved=True, reviewer="kim", for_whole_run=False, corrected_arguments=None
            )

    monkeypatch.chdir(tmp_path)
    calls = [
        ToolCall(id="c1", name="update_customer", arguments={"customer_id": "c-1", "email": "x"}),
        ToolCall(id="c2", name="delete_customer", arguments={"customer_id": "vip-7"}),
    ]
    namespace: dict[str, Any] = {
        "find_customer": find_customer,
        "update_customer": update_customer,
        "delete_customer": delete_customer,
        "ticketing": Ticketing(),
        "MODEL": ScriptedModel([calls, "Tidied up."]),
        "call": calls[0],
    }
    setup = _block("governance.md", "python", "async def ask_a_human(")
    code = _provider_free(_block("governance.md", "python", "Tidy up duplicate"), "MODEL")
    code = code.replace("postgresql://loom@db/loom", pg_dsn)
    code += "\nbudget, permissions = agent.budget, agent.permissions"
    for marker in ("await budget.status(", "permissions.check(call", 'Rule.allow("read_*")'):
        code += "\n" + _block("governance.md", "python", marker)
    code += "\n" + _block("governance.md", "python", "RegexGuardrail(")
    stores = _block("governance.md", "python", "InMemoryBudgetStore()")
    # The page's own absolute directory, moved into this test's; that store is then opened.
    stores = stores.replace("/var/lib/loom/", f"{tmp_path}/").replace(
        'SqlBudgetStore("sqlite:', 'own = SqlBudgetStore("sqlite:'
    )
    stores += "\nawait own.open()\nawait own.close()"
    code += "\n" + stores.replace("postgresql://loom@db/loom", pg_dsn)
    code += "\nawait runtime.close()\nreturn result"
    exec("async def snippet():\n" + textwrap.indent(setup + "\n" + code, "    "), namespace)
    result = await namespace["snippet"]()

    assert result.output == "Tidied up."
    outcomes = [m.content for m in result.messages if m.role == "tool"]
    assert outcomes[0] == "updated"
    assert "permission denied" in outcomes[1]  # the VIP rule, before the approval handler
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("user.cost_usd.daily ")  # budget.status(): one cap a line
    assert printed[-1].startswith("allow ")  # permissions.check(): behavior, reason, policy
    assert (tmp_path / "budget.db").exists()  # where the URL says, not below the working dir


def test_no_page_names_an_absolute_directory_with_a_relative_sqlite_url() -> None:
    # `sqlite:///var/lib/loom/budget.db` is the file var/lib/loom/budget.db below wherever the
    # process starts; the absolute one takes four slashes (`sqlite:////var/lib/...`).
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    wrong = re.compile(r"\b(?:sqlite|jsonl):///(?:var|srv|etc|opt|home|data|mnt|run)/\S*")
    found = [(p.name, m) for p in pages for m in wrong.findall(p.read_text())]
    assert found == []


def _commands() -> dict[tuple[str, ...], set[str]]:
    """Every command of the CLI (``("runs", "list")``) with the options it takes."""
    import argparse

    from loomflow.cli.main import _parser

    found: dict[tuple[str, ...], set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        found[path] = {o for a in parser._actions for o in a.option_strings}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))

    walk(_parser(), ())
    return found


@pytest.mark.parametrize("page", ["README.md", "docs/operations/cli.md"])
def test_every_option_a_command_table_names_is_one_that_command_takes(page: str) -> None:
    # A flag in the table that the command does not take is the first thing a new user types.
    commands = _commands()
    text = (ROOT / page).read_text()
    rows = [ln for ln in text.splitlines() if re.match(r"\| `(loomflow )?[a-z]+[ `]", ln)]
    checked = 0
    for row in rows:
        first = row.split(" | ")[0]
        for segment in re.findall(r"`([^`]+)`", first):
            words = segment.removeprefix("loomflow ").split()
            if not words or words[0] not in {p[0] for p in commands if p}:
                continue  # `--anonymous` or `reclaim` on its own: part of a neighbour
            paths = [(words[0],)]
            if len(words) > 1 and re.fullmatch(r"[a-z][a-z-]*(\\\|[a-z][a-z-]*)*", words[1]):
                paths = [(words[0], leaf) for leaf in words[1].split("\\|")]
            for path in paths:
                assert path in commands, f"{page}: no command {' '.join(path)!r}"
                for flag in re.findall(r"(?<![\w-])--?[a-z][a-z0-9.-]*", segment):
                    assert flag in commands[path], f"{page}: {' '.join(path)} takes no {flag}"
                    checked += 1
    assert checked > 50  # the tables were found and read


def test_sqlite_backup_commands_make_an_owner_only_copy(tmp_path: Path) -> None:
    # docs/operations/sqlite.md's backup commands, run as written under the usual umask 022:
    # sqlite3 made the copy 0644, the journal's prompts and answers readable by every account.
    if shutil.which("sqlite3") is None:
        pytest.skip("the sqlite3 command line tool is not installed")
    text = (DOCS / "operations" / "sqlite.md").read_text()
    block = re.search(r"## Backups.*?```bash\n(.*?)```", text, flags=re.S)
    assert block is not None
    journal = tmp_path / "journal.db"
    sqlite3.connect(journal).close()
    lines = block.group(1).splitlines()
    setup = "\n".join(line for line in lines if not line.startswith("sqlite3 "))
    for line in lines:
        if line.startswith("sqlite3 "):  # each makes the copy anew
            (tmp_path / "journal-backup.db").unlink(missing_ok=True)
            done = subprocess.run(
                ["bash", "-c", f"umask 022\n{setup}\n{line}"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode == 0, done.stderr
            mode = stat.S_IMODE((tmp_path / "journal-backup.db").stat().st_mode)
            assert mode == 0o600, f"{line!r} made a copy with mode {oct(mode)}"


async def test_agent_telemetry_and_upgrade_snippets_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/concepts/agents.md (the agent, then its stream), the telemetry page's test helpers
    # and price example, and the upgrade page's check for a 0.20 journal, as the pages show them.
    from loomflow.telemetry import Telemetry

    monkeypatch.chdir(tmp_path)  # the snippets journal to ./journal.db
    code = _provider_free(_block("concepts/agents.md", "python", "lookup_order"), "MODEL")
    code += "\nkinds = []\n" + _block("concepts/agents.md", "python", "agent.stream(")
    code = code.replace("    ...  #", "    kinds.append(type(event).__name__)  #")
    code += "\nawait agent.runtime.close()\nreturn kinds"
    namespace: dict[str, Any] = {"MODEL": ScriptedModel(["A-1042 is paid."])}
    exec("async def snippet():\n" + textwrap.indent(code, "    "), namespace)
    kinds = await namespace["snippet"]()
    assert (kinds[0], kinds[-1]) == ("RunStarted", "RunFinished")

    capture = _block("telemetry.md", "python", "MetricCapture()")
    capture = capture.replace("Agent(...,", "Agent('x', model=MODEL,")
    namespace = {"Agent": Agent, "Telemetry": Telemetry, "MODEL": ScriptedModel(["hello"])}
    exec("async def snippet():\n" + textwrap.indent(capture, "    "), namespace)
    await namespace["snippet"]()  # its own asserts count the run and its model call
    exec(_block("telemetry.md", "python", "ModelPrice("), {})  # its assert checks the price

    upgrade = _block("operations/upgrading.md", "python", "inspect_legacy_journal")
    namespace = {}
    code = upgrade + "\nawait runtime.close()\nreturn found"
    exec("async def snippet():\n" + textwrap.indent(code, "    "), namespace)
    assert await namespace["snippet"]() is None  # a new journal holds no 0.20 tables
