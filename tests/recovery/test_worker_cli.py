"""``loomflow worker`` and ``loomflow runs cancel|list`` as real processes on real journals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from _fleet import APP, app_env, cli, start_and_kill, start_blocked, tool_counts, wait_for
from _process_harness import harness as h  # the crash tests' process helpers

from loomflow.audit import AuditLog
from loomflow.recovery import Recovery
from loomflow.runtime import runtime_from_url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def journal_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    return str(request.getfixturevalue("pg_dsn"))


def _rows(out: str) -> dict[str, dict[str, object]]:
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {str(r["session_id"]): r for r in rows}


async def test_worker_once_recovers_the_orphans_and_lists_show_true_states(
    journal_url: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    env = app_env(journal_url, ledger)
    await start_and_kill(journal_url, ledger, 2, "once")
    code, out, err = await cli("--url", journal_url, "runs", "list", "--json", env=env)
    assert code == 0, err
    assert {k: r["state"] for k, r in _rows(out).items()} == {
        "once-0": "orphaned",
        "once-1": "orphaned",
    }
    code, out, err = await cli(
        "--url", journal_url, "runs", "list", "--state", "running", "--json", env=env
    )
    assert (code, out) == (0, "")
    code, out, err = await cli("worker", "_app:agents", "--once", "--json", env=env)
    assert code == 0, err
    report = json.loads(out.splitlines()[-1])
    assert sorted(r["session_id"] for r in report["resumed"]) == ["once-0", "once-1"]
    assert report["states"]["orphaned"] == 2
    assert tool_counts(ledger, "ship") == {"once-0": 1, "once-1": 1}
    code, out, err = await cli(
        "--url", journal_url, "runs", "list", "--state", "finished", "--json", env=env
    )
    rows = _rows(out)
    assert set(rows) == {"once-0", "once-1"}
    assert all(r["state"] == "finished" and r["agent"] == "orders" for r in rows.values())
    code, out, err = await cli("--url", journal_url, "runs", "list", env=env)
    assert code == 0
    assert out.count("finished") == 2
    code, out, err = await cli("--url", journal_url, "runs", "list", "--state", "zombie", env=env)
    assert code == 2
    assert "invalid choice" in err


async def test_worker_once_exits_1_when_a_resumed_run_fails(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(url, ledger, 1, "bad")
    code, out, _err = await cli(
        "worker", "_app:agents", "--once", env=app_env(url, ledger, FLEET_FAIL="1")
    )
    assert code == 1
    assert "resumed 1" in out
    code, out, _ = await cli("--url", url, "runs", "list", "--json", env=app_env(url, ledger))
    row = _rows(out)["bad-0"]
    assert row["state"] == "orphaned"
    assert row["attempts"] == 1
    assert row["last_error"] == "ConfigurationError: the carrier is down"


async def test_sigterm_releases_the_run_for_another_worker_at_once(
    journal_url: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(journal_url, ledger, 1, "term")
    # The first worker resumes the run and blocks in ship again; its lease is 30 s.
    blocking = app_env(journal_url, ledger, FLEET_BLOCK="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loomflow.cli",
        "worker",
        "_app:agents",
        "--port",
        "0",
        "--interval",
        "0.2",
        env=blocking,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_for(ledger, "blocked", 2)
        assert [line for line in ledger.read_text().splitlines() if str(proc.pid) in line]
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert "stopped: the runs it held are handed over" in out.decode()
    # Released: the next worker takes it now, far sooner than the 30 s lease.
    started = time.monotonic()
    code, out_text, err_text = await cli(
        "worker", "_app:agents", "--once", env=app_env(journal_url, ledger)
    )
    assert code == 0, err_text
    assert "resumed 1" in out_text
    assert time.monotonic() - started < 20
    assert tool_counts(ledger, "ship") == {"term-0": 1}
    assert tool_counts(ledger, "reserve") == {"term-0": 1}


async def test_sigterm_ends_a_sync_tool_in_flight_with_the_worker(
    journal_url: str, tmp_path: Path
) -> None:
    # A sync tool runs in a thread, which cancelling the run cannot stop. The worker handed
    # the run over and said so, then waited for the thread: the tool's body went on in the
    # stopping worker, beside the same step started again by the worker that took the run
    # over, and the worker exited only when the body returned (here 20 s, or never).
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(journal_url, ledger, 1, "sync", FLEET_SLOW_RESERVE="600")
    env = app_env(journal_url, ledger, FLEET_SLOW_RESERVE="20")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "loomflow.cli", "worker", "_app:agents", "--port", "0", "--interval", "0.2"),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_for(ledger, "blocked", 2)  # the worker is inside reserve's body
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
        took = time.monotonic() - started
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert took < 15, took
    assert "stopped: the runs it held are handed over" in out.decode()
    assert "1 sync tool call(s) were still running in threads" in err.decode()
    assert tool_counts(ledger, "reserved") == {}  # the body ended with its process
    # The run was handed over: the next worker resumes it at once, and runs the step again.
    code, _out, err_text = await cli(
        "worker", "_app:agents", "--once", env=app_env(journal_url, ledger)
    )
    assert code == 0, err_text
    assert tool_counts(ledger, "reserve") == {"sync-0": 3}
    assert tool_counts(ledger, "ship") == {"sync-0": 1}


async def test_runs_handed_over_by_stopping_workers_are_not_given_up_for_it(
    journal_url: str, tmp_path: Path
) -> None:
    # Each SIGTERM hand-over used up an attempt: a run resumed through as many rolling deploys
    # as --max-attempts was dead-lettered, "its worker died during the last", though no
    # worker had died and the run had never failed.
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(journal_url, ledger, 1, "deploy")
    blocking = app_env(journal_url, ledger, FLEET_BLOCK="1")
    for deploy in range(3):
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "loomflow.cli", "worker", "_app:agents"),
            *("--port", "0", "--interval", "0.2", "--max-attempts", "2"),
            env=blocking,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await wait_for(ledger, "blocked", deploy + 2)
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, err.decode()[-3000:]
        assert "the runs it held are handed over" in out.decode()
    code, out, err = await cli(
        "worker", "_app:agents", "--once", "--max-attempts", "2", env=app_env(journal_url, ledger)
    )
    assert code == 0, err
    assert "resumed 1" in out
    assert tool_counts(ledger, "ship") == {"deploy-0": 1}
    code, out, err = await cli("--url", journal_url, "runs", "list", "--json", env=blocking)
    assert _rows(out)["deploy-0"]["state"] == "finished"


async def test_cancel_stops_a_run_in_another_process_and_is_audited(
    journal_url: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    gate = tmp_path / "gate"
    env = app_env(journal_url, ledger)
    proc = await start_blocked(journal_url, ledger, 1, "cancel", gate)
    try:
        code, out, _ = await cli("--url", journal_url, "runs", "list", "--json", env=env)
        assert _rows(out)["cancel-0"]["state"] == "running"
        # Without --user: the one user who ran the session, as `runs show` finds it.
        code, out, err = await cli("--url", journal_url, "runs", "cancel", "cancel-0", env=env)
        assert code == 0, err
        assert "cancelled the run of session 'cancel-0' of user 'ana'" in out
        gate.touch()  # the step under way finishes; its result is refused, no step follows
        async with asyncio.timeout(30):
            child_out, child_err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, child_err.decode()[-3000:]
    assert "RunCancelledError" in child_out.decode()
    code, out, _ = await cli("--url", journal_url, "runs", "list", "--json", env=env)
    assert _rows(out)["cancel-0"]["state"] == "cancelled"
    # Nothing to cancel twice; never recovered.
    code, _, err = await cli(
        "--url", journal_url, "runs", "cancel", "cancel-0", "--user", "ana", env=env
    )
    assert code == 1
    assert "no open or interrupted run" in err
    runtime = runtime_from_url(journal_url)
    audit = AuditLog(journal_url, redact_logs=False)
    try:
        import _app

        agent = _app.Agent("x", model="scripted", runtime=runtime, name="orders", memory=False)
        report = await Recovery(runtime, {"orders": agent}).sweep()
        assert report.resumed == []
        assert report.states["cancelled"] == 1
        entries = (await audit.query(user_id="ana", action="run.cancel")).entries
        assert [e.actor.startswith("cli:") for e in entries] == [True]
        assert entries[0].session_id == "cancel-0"
    finally:
        await audit.close()
        await runtime.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "APP must be module:attribute"),
        ("no_such_module_anywhere:agents", "cannot import module"),
        ("_app:nothing_here", "has no attribute"),
        ("_app:PROMPT", "must be a non-empty mapping"),
        ("_app:SCRIPT", "must be a non-empty mapping"),
        ("_app:start", "the factory raised TypeError"),
        ("_app:ship", "the factory raised"),
    ],
)
async def test_bad_app_specs_are_clear_errors(spec: str, message: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    code, _out, err = await cli(
        "worker", spec, "--once", env=app_env(url, tmp_path / "ledger.jsonl")
    )
    assert code == 1
    assert message in err
    assert "Traceback" not in err


async def test_health_ready_and_metrics_endpoints(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loomflow.cli",
        "worker",
        "_app:agents",
        "--port",
        "0",
        "--interval",
        "0.2",
        "--json",
        env=app_env(url, tmp_path / "ledger.jsonl"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        serving = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        base = f"http://127.0.0.1:{serving['port']}"

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(base + path, timeout=5) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        assert (await asyncio.to_thread(get, "/healthz"))[0] == 200
        async with asyncio.timeout(30):
            while (await asyncio.to_thread(get, "/readyz"))[0] != 200:  # noqa: ASYNC110 - HTTP
                await asyncio.sleep(0.1)
        status, body = await asyncio.to_thread(get, "/metrics")
        assert status == 200
        assert 'loomflow_recoveries_total{outcome="dead_lettered"} 0.0' in body
        assert 'loomflow_runs_by_state{backend="sqlite",state="finished"}' in body
        assert (await asyncio.to_thread(get, "/nope"))[0] == 404

        def head(path: str) -> tuple[int, str | None, bytes]:
            request = urllib.request.Request(base + path, method="HEAD")
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    return response.status, response.headers["Content-Length"], response.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.headers["Content-Length"], exc.read()

        # Probes and load balancers that check with HEAD get GET's status, without a body.
        for path, status in (("/healthz", 200), ("/readyz", 200), ("/metrics", 200)):
            code, length, content = await asyncio.to_thread(head, path)
            assert (code, content) == (status, b""), path
            assert length is not None
            assert int(length) > 0
        assert (await asyncio.to_thread(head, "/nope"))[0] == 404
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await proc.wait()
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert APP.exists()


async def test_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    url = f"sqlite:///{tmp_path / 'journal.db'}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = await cli(
            "worker", "_app:agents", "--port", str(port), env=app_env(url, tmp_path / "l.jsonl")
        )
    assert code == 1
    assert f"cannot serve /metrics, /healthz and /readyz on 127.0.0.1:{port}" in err
    assert "Traceback" not in err


async def test_two_worker_processes_at_once_resume_each_run_once(
    journal_url: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    env = app_env(journal_url, ledger)
    await start_and_kill(journal_url, ledger, 6, "pair")
    results = await asyncio.gather(
        *(
            cli("worker", "_app:agents", "--once", "--json", "--worker-id", name, env=env)
            for name in ("w1", "w2")
        )
    )
    resumed: list[str] = []
    for code, out, err in results:
        assert code == 0, err
        resumed += [r["session_id"] for r in json.loads(out.splitlines()[-1])["resumed"]]
    assert sorted(resumed) == [f"pair-{i}" for i in range(6)]  # each by exactly one worker
    assert tool_counts(ledger, "ship") == {f"pair-{i}": 1 for i in range(6)}


async def test_the_installed_command_imports_the_app_from_where_it_starts(tmp_path: Path) -> None:
    # The README's layout: a package in the project directory, no PYTHONPATH. The console
    # script's sys.path holds its own bin directory, not the one it was started in.
    package = tmp_path / "myapp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "workers.py").write_text(
        "from loomflow import Agent\n"
        "from loomflow.models import ScriptedModel\n"
        "from loomflow.runtime import SqliteRuntime\n"
        "agent = Agent('x', name='orders', model=ScriptedModel(['done']),\n"
        "              runtime=SqliteRuntime('journal.db'))\n"
        "AGENTS = {agent.name: agent}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    env.pop("PYTHONPATH", None)
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "loomflow"),
        "worker",
        "myapp.workers:AGENTS",
        "--once",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert "sweep:" in out.decode()


@contextlib.asynccontextmanager
async def _fenced_out_worker(
    journal_url: str,
    tmp_path: Path,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    *args: str,
    **extra_env: str,
) -> AsyncIterator[tuple[dict[str, str], asyncio.subprocess.Process, Path]]:
    """Worker ``name`` (1 s lease) takes over orphaned run ``<name>-0`` and blocks in ``ship``;
    it is frozen (SIGSTOP) past its lease while this process resumes and finishes the run;
    then ``ship`` is let go and the worker thawed. Yields its environment, process, ledger."""
    import _app

    ledger = tmp_path / "ledger.jsonl"
    gate = tmp_path / "gate"
    await start_and_kill(journal_url, ledger, 1, name)
    env = app_env(
        journal_url, ledger, FLEET_BLOCK="1", FLEET_GATE=str(gate), FLEET_LEASE="1", **extra_env
    )
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "loomflow.cli", "worker", "_app:agents", *args),
        *("--port", "0", "--worker-id", name),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_for(ledger, "blocked", 2, timeout=30)
        # Never inside a lease renewal's write on SQLite: that would keep the file locked.
        sqlite_file = journal_url.removeprefix("sqlite:///")
        await h.freeze_pid(proc.pid, None if sqlite_file == journal_url else sqlite_file)
        await asyncio.sleep(2)  # past the worker's 1 s lease
        for key, value in app_env(journal_url, ledger).items():
            if key.startswith("FLEET_"):
                monkeypatch.setenv(key, value)
        monkeypatch.delenv("FLEET_BLOCK", raising=False)
        agent = _app.agents()["orders"]
        try:
            result = await agent.resume(_app.PROMPT, session_id=f"{name}-0", user_id="ana")
            assert result.output == "Reserved and shipped."
        finally:
            assert agent.runtime is not None
            assert isinstance(agent.audit, AuditLog)
            await agent.runtime.close()
            await agent.audit.close()
        gate.touch()
        proc.send_signal(signal.SIGCONT)
        yield env, proc, ledger
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()


async def test_a_frozen_worker_whose_run_was_taken_over_neither_fails_nor_dead_letters_it(
    journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker on its last attempt is frozen (SIGSTOP) past its lease; the application resumes
    # the run by hand and finishes it; the worker thaws and is fenced out. It used to count
    # that as its attempt failing: `--once` exited 1, the log said the run "raised (attempt 1
    # of 1)", and a `run.dead_letter` entry went into the audit trail of a finished run.
    async with _fenced_out_worker(
        journal_url, tmp_path, "frozen", monkeypatch, "--once", "--max-attempts", "1"
    ) as (env, proc, ledger):
        async with asyncio.timeout(60):
            _out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert "was taken over by another owner" in err.decode()
    assert tool_counts(ledger, "ship") == {"frozen-0": 2}  # the hand resume's, the thawed one's
    code, out, err_text = await cli("--url", journal_url, "runs", "list", "--json", env=env)
    assert code == 0, err_text
    row = _rows(out)["frozen-0"]
    assert (row["state"], row["last_error"]) == ("finished", None)
    audit = AuditLog(journal_url)
    try:
        assert (await audit.query(user_id="ana", action="run.dead_letter")).entries == []
        recovers = (await audit.query(user_id="ana", action="run.recover")).entries
        outcomes = [e.payload.get("outcome") for e in recovers if e.actor == "worker:frozen"]
        assert outcomes == [None, "claim_lost"]  # the claim, then how the resume ended
        assert (await audit.verify()).ok
    finally:
        await audit.close()


async def test_worker_exports_the_spans_of_the_runs_it_resumes(tmp_path: Path) -> None:
    # The worker is a process of its own: no application code calls setup_telemetry() in it,
    # so with the standard OTEL_* variables set it traced nothing of the runs it resumed.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(url, ledger, 1, "traced", FLEET_TELEMETRY="1")
    env = app_env(
        url, ledger, FLEET_TELEMETRY="1", OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="fleet"
    )
    code, out, err = await cli("worker", "_app:agents", "--once", "--port", "0", env=env)
    assert code == 0, err
    assert '"name": "invoke_agent orders"' in out
    assert '"name": "loom.workflow.step"' in out
    assert '"loom.run.resumed": true' in out


def test_a_missing_module_says_where_it_was_looked_for_and_a_missing_dependency_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from loomflow.cli.worker import load_app
    from loomflow.errors import UserError

    monkeypatch.setattr(sys, "path", list(sys.path))  # load_app adds the working directory
    monkeypatch.chdir(tmp_path)
    (tmp_path / "needs_a_dependency_xyz.py").write_text("import not_installed_anywhere_xyz\n")
    with pytest.raises(UserError) as caught:
        load_app("needs_a_dependency_xyz:AGENTS")
    # The application was found: what is missing is one of its own imports.
    assert "importing 'needs_a_dependency_xyz' failed" in str(caught.value)
    assert "not_installed_anywhere_xyz" in str(caught.value)
    with pytest.raises(UserError) as caught:
        load_app("not_here_xyz.workers:AGENTS")
    assert "cannot import module 'not_here_xyz.workers'" in str(caught.value)
    assert f"in the directory the worker starts in ({tmp_path})" in str(caught.value)
    # A Team in AGENTS: its runs are its lead's, and the refusal says to register the lead.
    (tmp_path / "team_app_xyz.py").write_text(
        "from loomflow.agent import Agent\n"
        "from loomflow.agent.architectures import Team\n"
        "lead = Agent('l', model='scripted', name='lead')\n"
        "AGENTS = {'lead': Team(lead, [Agent('w', model='scripted', name='w')])}\n"
    )
    with pytest.raises(UserError, match=r"register team\.lead as 'lead'"):
        load_app("team_app_xyz:AGENTS")


async def test_an_async_factory_is_refused_without_a_stray_warning(tmp_path: Path) -> None:
    # Calling an `async def` factory makes a coroutine that is never awaited: the refusal
    # must be the one line on stderr, not followed by Python's "never awaited" warning.
    (tmp_path / "async_factory_app.py").write_text("async def AGENTS():\n    return {}\n")
    env = app_env(f"sqlite:///{tmp_path / 'journal.db'}", tmp_path / "ledger.jsonl")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    code, _out, err = await cli("worker", "async_factory_app:AGENTS", "--once", env=env)
    assert code == 1
    assert "the factory must be a plain function, not async" in err
    assert "never awaited" not in err


async def _orphans_edited(
    tmp_path: Path, count: int, prefix: str, edit: str, *params: object
) -> tuple[str, Path]:
    """``count`` runs orphaned in a SQLite journal (their process killed), then ``edit`` run
    on the file by hand: the journal's URL and the ledger."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'journal.db'}"
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(url, ledger, count, prefix)
    with sqlite3.connect(tmp_path / "journal.db") as db:
        db.execute(edit, params)
    db.close()
    return url, ledger


async def test_a_crafted_last_error_is_printed_escaped_and_cut_when_its_run_is_given_up(
    tmp_path: Path,
) -> None:
    # A run out of attempts is given up with its last error in the reason. A hand-edited
    # 200 KB last_error holding terminal escapes went raw into the worker's output (recolouring
    # the terminal, a carriage return overwriting the line) and whole into its log line.
    crafted = "RuntimeError: boom \x1b[31mRED\x1b[0m\rFORGED\n" + "x" * 200_000
    url, ledger = await _orphans_edited(
        tmp_path, 1, "esc", "UPDATE loom_sessions SET attempts = 5, last_error = ?", crafted
    )
    code, out, err = await cli("worker", "_app:agents", "--once", env=app_env(url, ledger))
    assert code == 0, err
    raw = "\x1b" in out or "\r" in out
    assert not raw, "the worker printed a terminal control"
    [line] = [text for text in out.splitlines() if "dead letter" in text]
    assert "boom \\x1b[31mRED\\x1b[0m\\rFORGED\\nxxx" in line
    assert len(line) < 5_000, f"a line of {len(line)} characters"
    [logged] = [text for text in err.splitlines() if "gave up on session" in text]
    assert len(logged) < 5_000, f"a log line of {len(logged)} characters"


async def test_a_corrupt_step_run_again_by_a_worker_is_logged_with_its_run_and_why(
    tmp_path: Path,
) -> None:
    # The warning only named the step ("journal entry for step 'tool_call_0_0_...' is
    # corrupt"): with several runs resumed, an SRE could not tell which run's row was damaged,
    # nor how (bad JSON, an unknown format, a newer codec).
    url, ledger = await _orphans_edited(
        tmp_path,
        2,
        "bad",
        "UPDATE loom_entries SET value = X'7b6e6f74206a736f6e' "
        """WHERE scope = '["bad-1","ana"]' AND name LIKE 'tool_call_0%'""",
    )
    code, _out, err = await cli("worker", "_app:agents", "--once", env=app_env(url, ledger))
    assert code == 0, err
    [line] = [text for text in err.splitlines() if "is corrupt" in text]
    assert "of session 'bad-1' of user 'ana'" in line
    assert "not valid JSON" in line
    assert tool_counts(ledger, "reserve") == {"bad-0": 1, "bad-1": 2}


async def test_an_error_holding_a_nul_is_kept_as_the_runs_last_error_and_dead_letter(
    journal_url: str, tmp_path: Path
) -> None:
    # PostgreSQL text holds no NUL: a resumed run whose error held one (a tool's message, a
    # lone surrogate too) lost its last error ("recovery bookkeeping failed"), and its last
    # attempt was not given up, so the dead letter that followed said no error at all.
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(journal_url, ledger, 1, "nul")
    failing = app_env(
        journal_url, ledger, FLEET_FAIL="1", FLEET_FAIL_MESSAGE="carrier said \\x00 and \\udce9"
    )
    env = app_env(journal_url, ledger)
    for attempt, state in ((1, "orphaned"), (2, "failed")):
        if attempt == 2:
            await asyncio.sleep(1.5)  # the backoff after the first attempt
        code, _out, err = await cli(
            "worker", "_app:agents", "--once", "--max-attempts", "2", env=failing
        )
        assert code == 1, err
        assert "bookkeeping failed" not in err
        code, out, err = await cli("--url", journal_url, "runs", "list", "--json", env=env)
        assert code == 0, err
        row = _rows(out)["nul-0"]
        assert (row["state"], row["attempts"]) == (state, attempt)
        assert row["last_error"] == "ConfigurationError: carrier said \ufffd and \ufffd"


_HOLD_LOCK = """
import os, sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
"""


async def _orphan_with_audit_locked(
    tmp_path: Path, prefix: str, audit_db: Path, unlock: Path
) -> tuple[str, Path, asyncio.subprocess.Process]:
    """One run orphaned in a SQLite journal, and an audit store ``audit_db`` whose write lock
    another process holds until ``unlock`` exists: the journal's URL, the ledger, that
    process."""
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    ledger = tmp_path / "ledger.jsonl"
    await start_and_kill(url, ledger, 1, prefix)
    code, _out, err = await cli(
        "--url", f"sqlite:///{audit_db}", "migrate", env=app_env(url, ledger)
    )
    assert code == 0, err
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD_LOCK, str(audit_db), str(unlock), stdout=asyncio.subprocess.PIPE
    )
    assert holder.stdout is not None
    assert await asyncio.wait_for(holder.stdout.readline(), 30) == b"locked\n"
    return url, ledger, holder


async def test_an_audit_log_that_is_down_uses_up_no_attempt_of_the_runs_it_holds_back(
    tmp_path: Path,
) -> None:
    # A worker audits a recovery before the run starts, and does not start it when the audit
    # log refuses. That refusal counted as the run's attempt failing: an audit store locked
    # for half a minute made a dead letter of every run due then, none of which had run.
    audit_db, unlock = tmp_path / "audit.db", tmp_path / "unlock"
    url, ledger, holder = await _orphan_with_audit_locked(tmp_path, "down", audit_db, unlock)
    env = app_env(url, ledger)
    down = app_env(
        url, ledger, FLEET_AUDIT_URL=f"sqlite:///{audit_db}", LOOMFLOW_SQLITE_BUSY_TIMEOUT_MS="100"
    )
    try:
        for _ in range(3):  # more than --max-attempts
            code, _out, err = await cli(
                "worker", "_app:agents", "--once", "--max-attempts", "2", env=down
            )
            assert code == 1, err
            assert "audit" in err
            code, out, err = await cli("--url", url, "runs", "list", "--json", env=env)
            assert _rows(out)["down-0"]["state"] == "orphaned", err
    finally:
        unlock.touch()
        async with asyncio.timeout(30):
            await holder.wait()
    code, out, err = await cli("worker", "_app:agents", "--once", "--max-attempts", "2", env=down)
    assert code == 0, err
    assert tool_counts(ledger, "ship") == {"down-0": 1}
    code, out, err = await cli("--url", url, "runs", "list", "--json", env=env)
    assert _rows(out)["down-0"]["state"] == "finished", err


async def test_a_fenced_out_worker_counts_its_run_as_claim_lost_not_failed(
    journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, with a long-running worker that serves /metrics: the run finished elsewhere,
    # so the thawed worker's run must not count as failed (loomflow_runs_total, the
    # LoomflowRunsFailing alert) nor audit a run.end saying so.
    async with _fenced_out_worker(
        journal_url, tmp_path, "fenced", monkeypatch, "--json", "--interval", "0.2",
        FLEET_TELEMETRY="1",
    ) as (_, proc, _ledger):  # fmt: skip
        assert proc.stdout is not None
        serving = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))

        def metrics() -> str:
            url = f"http://127.0.0.1:{serving['port']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read().decode())

        claim_lost = 'loomflow_recoveries_total{outcome="claim_lost"} 1.0'
        async with asyncio.timeout(20):
            while claim_lost not in (body := await asyncio.to_thread(metrics)):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            _out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    backend = "sqlite" if journal_url.startswith("sqlite") else "postgres"
    runs = f'loomflow_runs_total{{backend="{backend}",outcome="%s",resumed="true"}}'
    assert runs % "failed" + " 0.0" in body
    assert runs % "claim_lost" + " 1.0" in body
    audit = AuditLog(journal_url)
    try:
        ends = (await audit.query(user_id="ana", action="run.end")).entries
        # The hand resume's run completed; the thawed worker's run (another run id) was
        # fenced out, and says so.
        assert sorted((e.payload["outcome"], e.payload.get("error_type")) for e in ends) == [
            ("claim_lost", "OwnershipLostError"),
            ("completed", None),
        ]
        assert (await audit.verify()).ok
    finally:
        await audit.close()
