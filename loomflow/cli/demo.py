"""``loomflow demo``: crash a real worker mid-run, resume it, and show what the journal did."""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ulid import ULID

from ..agent import RunResult
from ..config import Settings, _masked_url
from ..errors import LoomflowError
from ..messages import Message
from ..models import Model
from ..runtime import StepEvent, runtime_from_url
from ..stores import Stores
from ._demo_task import PLAN, TOKEN_CAP, TOOL_NAMES, build_model, close_model, governance, run_task


@dataclass
class _Story:
    url: str
    on_postgres: bool
    work: Path
    stop_after: int
    spec: str | None  # the --model given, None for the scripted model
    model: Model
    handshake_s: float
    # New per demo, so an old journal never replays and earlier demos' budget use and audit
    # entries (in a reused PostgreSQL database) never mix into this report.
    run: str

    @property
    def session(self) -> str:
        return f"order-A-1042-{self.run}"

    @property
    def user(self) -> str:
        return f"alice+{self.run[-6:].lower()}@example.com"

    @property
    def journal(self) -> Path:
        """The SQLite journal (not used on PostgreSQL): a name of this demo's own, so a
        user's ``journal.db`` in the same directory is never touched."""
        return self.work / f"loomflow-demo-{self.run}.db"

    @property
    def ledger(self) -> Path:
        return self.work / f"loomflow-demo-{self.run}-side-effects.jsonl"


@dataclass
class _Worker:
    pid: int
    killed: bool  # False: the model finished before the kill point and the worker exited


def _spawn_until_step(story: _Story) -> _Worker:
    """Start the worker, wait for its handshake before turn ``stop_after``, SIGKILL it."""
    cmd = [
        sys.executable,
        "-m",
        "loomflow.cli._demo_task",
        story.url,
        str(story.ledger),
        story.session,
        story.user,
        "--stop-after",
        str(story.stop_after),
    ]
    if story.spec is not None:
        cmd += ["--model", story.spec]
    timeout = story.handshake_s
    # A session of its own: Ctrl-C at the terminal reaches the demo, which stops the worker
    # below, rather than a worker that may still be importing (a traceback, not an answer).
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True) as child:
        assert child.stdout is not None
        try:
            line = _readline(child, timeout).strip()
            if line == "RUN-DONE":
                child.wait(timeout=timeout)
                return _Worker(child.pid, killed=False)
            if line != f"STEP-DONE {story.stop_after}":
                raise LoomflowError(
                    f"the demo worker said {line!r} instead of its handshake"
                    if line
                    else f"the demo worker failed with exit status {child.wait(timeout)} "
                    "(its error is printed above)"
                )
        finally:
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=10)
        return _Worker(child.pid, killed=True)


def _readline(child: subprocess.Popen[str], timeout: float) -> str:
    assert child.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise LoomflowError(f"the demo worker gave no handshake within {timeout:g}s")
    return child.stdout.readline()


def run_demo(
    *,
    postgres: str | None,
    workdir: Path | None,
    stop_after: int,
    model: str | None = None,
    handshake_s: float = 120.0,
) -> int:
    """Run the demo story and print the report; returns the process exit code."""
    if model is None and not 1 <= stop_after < len(PLAN):
        print(
            f"loomflow: error: --kill-after must be between 1 and {len(PLAN) - 1} with the "
            "scripted model",
            file=sys.stderr,
        )
        return 2
    if stop_after < 1:
        print("loomflow: error: --kill-after must be at least 1", file=sys.stderr)
        return 2
    if workdir is not None and workdir.exists() and not workdir.is_dir():
        # A device or a socket is no file either, and mkdir would only say "File exists".
        what = "a file, not a directory" if workdir.is_file() else "not a directory"
        print(f"loomflow: error: --workdir {workdir} is {what}", file=sys.stderr)
        return 2
    return asyncio.run(_start(postgres, workdir, stop_after, model, handshake_s))


async def _start(
    postgres: str | None,
    workdir: Path | None,
    stop_after: int,
    spec: str | None,
    handshake_s: float,
) -> int:
    # Built before anything else, so a missing SDK, driver or API key leaves nothing behind.
    if postgres is not None:
        # Reached here first, so a server that does not answer is one error line before the
        # story starts, not the worker's error and then the story's own.
        runtime = runtime_from_url(postgres)  # names the extra to install when asyncpg is missing
        try:
            await runtime.open()
        finally:
            await runtime.close()
    model = build_model(spec)
    try:
        work = workdir or Path(tempfile.mkdtemp(prefix="loomflow-demo-"))
        try:
            work.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file on the way, no permission, a read-only disk
            print(
                f"loomflow: error: --workdir {work} cannot be made: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return 2
        story = _Story(
            url=postgres or "",
            on_postgres=postgres is not None,
            work=work.resolve(),
            stop_after=stop_after,
            spec=spec,
            model=model,
            handshake_s=handshake_s,
            run=str(ULID()),
        )
        if not story.on_postgres:
            story.url = f"sqlite:///{story.journal}"
            await _migrate_new_journal(story.url)
        return await _tell(story)
    finally:
        await close_model(model)


async def _migrate_new_journal(url: str) -> None:
    """Create the tables of the demo's own SQLite journal before its worker starts.

    The file is new on every run, so with ``LOOMFLOW_AUTO_MIGRATE=false`` (a production
    setting) the worker would stop and name a file to migrate that the next demo never uses.
    The audit log and the budget live in that file too, whatever their settings say.
    """
    settings = Settings(runtime_url=url, audit_url=None, budget_url=None)
    async with Stores(settings) as stores:
        await stores.migrate()


async def _tell(story: _Story) -> int:
    model, k = story.model, story.stop_after
    backend = "PostgreSQL" if story.on_postgres else f"SQLite ({story.journal})"
    who = (
        "a scripted model (offline)"
        if story.spec is None
        else f"{model.provider} model {model.name}"
    )
    print(f"loomflow demo: journal on {backend}; {who}\n")
    print(f"1. A worker process runs the order agent for {story.user} (session {story.session}).")
    worker = await asyncio.to_thread(_spawn_until_step, story)
    if worker.killed:
        turns = "turn and its" if k == 1 else f"{k} turns and their"
        print(
            f"2. After the model's first {turns} tool calls were journaled, the worker "
            f"(pid {worker.pid}) was killed with SIGKILL while starting model call {k}."
        )
    else:
        print(
            f"2. The model finished before turn {k}, so the worker (pid {worker.pid}) exited "
            "before the kill point; resuming shows a finished run replaying."
        )
    held = await _holds(story)
    print("3. This process resumes the run: agent.resume(prompt, session_id, user_id).\n")
    steps: list[StepEvent] = []
    runtime = runtime_from_url(story.url)
    try:
        result = await run_task(
            runtime,
            story.ledger,
            story.session,
            story.user,
            model=model,
            resume=True,
            steps=steps,
        )
    finally:
        await runtime.close()

    effects = Counter(json.loads(line)["action"] for line in story.ledger.read_text().splitlines())
    print(f"{'journaled step':<34} {'on resume':<22} {'tool ran (both processes)':>26}")
    print("-" * 84)
    for event in steps:
        if event.path:
            continue
        tool = _tool_of(event.name, result.messages)
        outcome = "replayed from journal" if event.outcome == "hit" else "ran fresh"
        count = f"{effects[tool]}x" if tool is not None else "-"
        label = tool or event.name
        if event.name.startswith("persist_episode_"):
            label = "the run's episode (memory)"  # the agent's default memory
        print(f"{label:<34} {outcome:<22} {count:>26}")
    print(f"\nfinal answer: {result.output}")

    trail, status = await _governance_report(story)
    print(
        f"\naudit trail of {story.user} for this session ({len(trail) - 1} entries, "
        "both processes):"
    )
    for line in trail:
        print(f"  {line}")
    _print_budget(result, steps, held, status, free=story.spec is None)
    hits = sum(1 for e in steps if e.outcome == "hit")
    misses = sum(1 for e in steps if e.outcome != "hit")
    divergences = sum(1 for e in steps if e.outcome == "divergence")
    print(
        f"replay metrics: hits={hits} misses={misses} divergences={divergences} "
        f"hit ratio={hits / max(hits + misses, 1):.0%}"
    )
    return _verdict(story, result, effects)


def _verdict(story: _Story, result: RunResult, effects: Counter[str]) -> int:
    """0 when every tool call the run made left exactly one side effect, else 1."""
    calls = _completed_calls(result.messages)
    repeated = sorted(name for name, n in effects.items() if n > calls[name])
    lost = sorted(name for name, n in calls.items() if effects[name] < n)
    expected = TOOL_NAMES if story.spec is None else []
    missing = sorted(name for name in expected if effects[name] == 0)
    if repeated or lost or missing or result.interrupted:
        print(
            f"FAILED: side effects repeated {repeated}, tool calls without their side effect "
            f"{lost}, tools never called {missing}, run interrupted: "
            f"{result.interruption_reason or 'no'}"
        )
        return 1
    print(
        f"No side effect ran twice: each of the {sum(calls.values())} tool calls the model made "
        "happened exactly once."
    )
    if story.on_postgres:
        print("The journal is in your PostgreSQL database; the side-effect ledger is")
        print(f"  {story.ledger}")
    else:
        print(f"Journal and side-effect ledger kept in {story.work}:")
        print(f"  {story.journal.name}, {story.ledger.name}")
    # The DSN as given, password masked: the user puts it back in (or uses PGPASSWORD).
    masked = _masked_url(story.url)
    if masked != story.url:
        print("The URL's password is shown as ***: put yours back, or drop it and set PGPASSWORD.")
    where = shlex.quote(masked)
    print(f"Look around: {command_name()} --url {where} runs show {story.session}")
    return 0


def command_name() -> str:
    """How the user can run ``loomflow`` from where they are: just ``loomflow`` when that
    is on PATH and is this program, else the path they ran (``.venv/bin/loomflow``)."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "loomflow"
    if argv0.endswith("__main__.py") or argv0 == "-m":  # python -m loomflow (or loomflow.cli)
        module = "loomflow.cli" if Path(argv0).parent.name == "cli" else "loomflow"
        return f"{shlex.quote(_shorter(sys.executable))} -m {module}"
    on_path = shutil.which("loomflow")
    if on_path is not None and Path(on_path).resolve() == Path(argv0).resolve():
        return "loomflow"
    if on_path is not None and os.sep not in argv0:
        return "loomflow"
    return shlex.quote(_shorter(argv0))


def _shorter(path: str) -> str:
    """``path`` relative to the working directory when it is inside it (not resolving
    symlinks: a venv's ``bin/python`` links to the base interpreter)."""
    absolute = Path(os.path.abspath(path))
    try:
        relative = absolute.relative_to(Path.cwd())
    except ValueError:
        return str(absolute)
    return str(relative) if len(relative.parts) > 1 else f"./{relative}"


def _completed_calls(messages: list[Message]) -> Counter[str]:
    """How many calls of each tool returned a result: what the ledger must show.

    Counted per tool, not per arguments: a tool may normalise what the model sent
    (``"2"`` becomes ``2``), and a call the tool refused leaves no side effect.
    """
    return Counter(m.name or "" for m in messages if m.role == "tool" and not m.is_error)


def _tool_of(step_name: str, messages: list[Message]) -> str | None:
    """``tool_call_<turn>_<slot>_<hash>`` -> the tool it ran; None for model calls."""
    if not step_name.startswith("tool_call_"):
        return None
    turn, slot = (int(x) for x in step_name.split("_")[2:4])
    return [m for m in messages if m.role == "assistant"][turn].tool_calls[slot].name


@dataclass
class _Budget:
    used: float
    reserved: float
    limit: float


async def _holds(story: _Story) -> float:
    """Tokens the killed worker still holds in the budget store for its call in flight."""
    runtime = runtime_from_url(story.url)
    try:
        await runtime.open()
        _, budget = governance(runtime, story.model)
        return sum(
            r.amount.tokens_in + r.amount.tokens_out
            for r in await budget.store.reservations()
            if any(b.scope == "user" and b.user_id == story.user for b in r.buckets)
        )
    finally:
        await runtime.close()


def _print_budget(
    result: RunResult, steps: list[StepEvent], held: float, status: _Budget, *, free: bool
) -> None:
    spent = result.tokens_in + result.tokens_out
    calls = [e for e in steps if e.name.startswith("model_call_") and not e.path]
    before = sum(1 for e in calls if e.outcome == "hit")
    print(
        f"budget: {status.used:,.0f} of {status.limit:,.0f} tokens used "
        f"({status.used / status.limit:.1%}), {status.reserved:,.0f} held"
    )
    print(
        f"  {spent:>7,}  by the {len(calls)} model calls that returned ({before} before the kill, "
        f"{len(calls) - before} after resume;\n           replayed calls are not charged again)"
    )
    charged = status.used - spent
    if held and charged > 0:
        print(
            f"  {charged:>7,.0f}  reserved by the killed worker for the call it was starting; "
            "this process reclaimed\n           the dead worker's hold and charged it. "
            "loomflow cannot tell whether a call in flight\n           reached the provider, "
            "so on_expiry='charge' (the default) never undercounts;\n"
            "           StandardBudget(on_expiry='release') would give it back"
        )
    print(
        f"tokens of the run: {result.tokens_in} in, {result.tokens_out} out; "
        f"cost ${result.cost_usd:.4f}" + (" (the scripted model is free)" if free else "")
    )


async def _governance_report(story: _Story) -> tuple[list[str], _Budget]:
    runtime = runtime_from_url(story.url)
    try:
        await runtime.open()
        audit, budget = governance(runtime, story.model)
        page = await audit.query(user_id=story.user, session_id=story.session, limit=500)
        trail = []
        # A start whose execution has no outcome entry is the work the kill cut short.
        ended = {
            (e.payload or {}).get("execution")
            for e in page.entries
            if e.action in ("model.call", "model.error", "tool.result")
        }
        for entry in page.entries:
            detail = (entry.payload or {}).get("tool") or (entry.payload or {}).get("outcome") or ""
            if entry.action == "run.start":
                detail = (
                    "resumed the open run" if (entry.payload or {}).get("resumed") else "new run"
                )
            execution = (entry.payload or {}).get("execution")
            if entry.action in ("model.start", "tool.call") and execution not in (None, *ended):
                detail = f"{detail} (no outcome: the worker was killed during it)".lstrip()
            trail.append(f"#{entry.seq:<3} {entry.action:<16} {detail}".rstrip())
        report = await audit.verify(user_id=story.user)
        trail.append(f"chain verified: {'ok' if report.ok else 'PROBLEMS FOUND'}")
        cap = next(c for c in await budget.status(story.user) if c.cap == "user.tokens_total")
        return trail, _Budget(cap.used, cap.reserved, float(TOKEN_CAP))
    finally:
        await runtime.close()
