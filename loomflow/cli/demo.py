"""``loomflow demo``: crash a real worker mid-run, resume it, and show what the journal did."""

from __future__ import annotations

import asyncio
import json
import selectors
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulid import ULID

from ..agent import RunResult
from ..errors import LoomflowError
from ..messages import Message
from ..models import Model
from ..runtime import StepEvent, runtime_from_url
from ._demo_task import PLAN, TOKEN_CAP, TOOL_NAMES, build_model, close_model, governance, run_task

USER = "alice@example.com"


@dataclass
class _Worker:
    pid: int
    killed: bool  # False: the model finished before the kill point and the worker exited


def _spawn_until_step(
    url: str, ledger: Path, session: str, stop_after: int, model: str | None, timeout: float
) -> _Worker:
    """Start the worker, wait for its handshake before turn ``stop_after``, SIGKILL it."""
    cmd = [
        sys.executable,
        "-m",
        "loomflow.cli._demo_task",
        url,
        str(ledger),
        session,
        USER,
        "--stop-after",
        str(stop_after),
    ]
    if model is not None:
        cmd += ["--model", model]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        try:
            line = _readline(child, timeout).strip()
            if line == "RUN-DONE":
                child.wait(timeout=timeout)
                return _Worker(child.pid, killed=False)
            if line != f"STEP-DONE {stop_after}":
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
        print(f"--kill-after must be between 1 and {len(PLAN) - 1}", file=sys.stderr)
        return 2
    if stop_after < 1:
        print("--kill-after must be at least 1", file=sys.stderr)
        return 2
    work = workdir or Path(tempfile.mkdtemp(prefix="loomflow-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ledger = work / "side-effects.jsonl"
    ledger.unlink(missing_ok=True)
    journal = work / "journal.db"
    url = postgres or f"sqlite:///{journal.resolve()}"
    if not postgres:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{journal}{suffix}").unlink(missing_ok=True)
    return asyncio.run(_story(url, postgres is not None, work, stop_after, model, handshake_s))


async def _story(
    url: str, on_postgres: bool, work: Path, stop_after: int, spec: str | None, handshake_s: float
) -> int:
    # Built first, so a missing SDK or API key fails before anything runs.
    model = build_model(spec)
    try:
        return await _tell(url, on_postgres, work, stop_after, spec, model, handshake_s)
    finally:
        await close_model(model)


async def _tell(
    url: str,
    on_postgres: bool,
    work: Path,
    stop_after: int,
    spec: str | None,
    model: Model,
    handshake_s: float,
) -> int:
    ledger = work / "side-effects.jsonl"
    session = f"order-A-1042-{ULID()}"  # a new session per demo, so old journals never replay
    backend = "PostgreSQL" if on_postgres else f"SQLite ({work / 'journal.db'})"
    who = "a scripted model (offline)" if spec is None else f"{model.provider} model {model.name}"
    print(f"loomflow demo: journal on {backend}; {who}\n")
    print(f"1. A worker process runs the order agent for {USER} (session {session}).")
    worker = await asyncio.to_thread(
        _spawn_until_step, url, ledger, session, stop_after, spec, handshake_s
    )
    if worker.killed:
        print(
            f"2. When the model was asked for turn {stop_after} (turns 0-{stop_after - 1} and "
            f"their tool calls journaled), the worker (pid {worker.pid}) was killed with SIGKILL."
        )
    else:
        print(
            f"2. The model finished before turn {stop_after}, so the worker (pid {worker.pid}) "
            "exited before the kill point; resuming shows a finished run replaying."
        )
    held = await _holds(url, model)
    print("3. This process resumes the run: agent.resume(prompt, session_id, user_id).\n")
    steps: list[StepEvent] = []
    runtime = runtime_from_url(url)
    try:
        result = await run_task(
            runtime, ledger, session, USER, model=model, resume=True, steps=steps
        )
    finally:
        await runtime.close()

    effects = Counter(_effect_key(json.loads(line)) for line in ledger.read_text().splitlines())
    calls = _tool_calls(result.messages)
    print(f"{'journaled step':<34} {'on resume':<22} {'side effects':>12}")
    print("-" * 70)
    for event in steps:
        if event.path:
            continue
        call = _call_of(event.name, result.messages)
        outcome = "replayed from journal" if event.outcome == "hit" else "ran fresh"
        count = str(effects[call]) if call is not None else "-"
        label = call[0] if call is not None else event.name
        print(f"{label:<34} {outcome:<22} {count:>12}")
    print(f"\nfinal answer: {result.output}")

    trail, status = await _governance_report(url, session, model)
    print(f"\naudit trail of {USER} for this session ({len(trail) - 1} entries, both processes):")
    for line in trail:
        print(f"  {line}")
    _print_budget(result, steps, held, status)
    hits = sum(1 for e in steps if e.outcome == "hit")
    misses = sum(1 for e in steps if e.outcome != "hit")
    divergences = sum(1 for e in steps if e.outcome == "divergence")
    print(
        f"replay metrics: hits={hits} misses={misses} divergences={divergences} "
        f"hit ratio={hits / max(hits + misses, 1):.0%}"
    )

    repeated = sorted(name for (name, args), n in effects.items() if n > calls[(name, args)])
    unmatched = sorted(name for (name, args), n in calls.items() if effects[(name, args)] < n)
    expected = TOOL_NAMES if spec is None else []
    missing = sorted(name for name in expected if not any(k[0] == name for k in effects))
    if repeated or unmatched or missing or result.interrupted:
        print(
            f"FAILED: repeated side effects {repeated}, tool calls without their side effect "
            f"{unmatched}, missing {missing}, interrupted: {result.interrupted}"
        )
        return 1
    print(
        f"No side effect ran twice: each of the {sum(calls.values())} tool calls the model made "
        "happened exactly once."
    )
    print(f"Journal and side-effect ledger kept in {work}")
    return 0


def _effect_key(record: dict[str, Any]) -> tuple[str, str]:
    return record["action"], json.dumps(record.get("args", {}), sort_keys=True)


def _tool_calls(messages: list[Message]) -> Counter[tuple[str, str]]:
    """How often the run called each (tool, arguments): what the ledger must show."""
    return Counter(
        (call.name, json.dumps(call.arguments, sort_keys=True))
        for m in messages
        if m.role == "assistant"
        for call in m.tool_calls
    )


def _call_of(step_name: str, messages: list[Message]) -> tuple[str, str] | None:
    """``tool_call_<turn>_<slot>_<hash>`` -> the (tool, arguments) it ran; None for model calls."""
    if not step_name.startswith("tool_call_"):
        return None
    turn, slot = (int(x) for x in step_name.split("_")[2:4])
    call = [m for m in messages if m.role == "assistant"][turn].tool_calls[slot]
    return call.name, json.dumps(call.arguments, sort_keys=True)


@dataclass
class _Budget:
    used: float
    reserved: float
    limit: float


async def _holds(url: str, model: Model) -> float:
    """Tokens the killed worker still holds in the budget store for its call in flight."""
    runtime = runtime_from_url(url)
    try:
        await runtime.open()
        _, budget = governance(runtime, model)
        return sum(
            r.amount.tokens_in + r.amount.tokens_out
            for r in await budget.store.reservations()
            if any(b.scope == "user" and b.user_id == USER for b in r.buckets)
        )
    finally:
        await runtime.close()


def _print_budget(result: RunResult, steps: list[StepEvent], held: float, status: _Budget) -> None:
    spent = result.tokens_in + result.tokens_out
    calls = [e for e in steps if e.name.startswith("model_call_") and not e.path]
    before = sum(1 for e in calls if e.outcome == "hit")
    print(
        f"budget of {USER}: {status.used:,.0f} of {status.limit:,.0f} tokens used "
        f"({status.used / status.limit:.1%}), {status.reserved:,.0f} held"
    )
    print(
        f"  {spent:>7,}  by the {len(calls)} model calls that returned ({before} before the kill, "
        f"{len(calls) - before} after resume;\n           replayed calls are not charged again)"
    )
    charged = status.used - spent
    if held and charged > 0:
        print(
            f"  {charged:>7,.0f}  the hold of the call in flight when the worker died "
            f"({held:,.0f} reserved), charged when this\n           process reclaimed it: "
            "on_expiry='charge' counts a call the provider may have billed;\n"
            "           StandardBudget(on_expiry='release') would give it back"
        )
    print(
        f"tokens of the run: {result.tokens_in} in, {result.tokens_out} out; "
        f"cost ${result.cost_usd:.4f}"
    )


async def _governance_report(url: str, session: str, model: Model) -> tuple[list[str], _Budget]:
    runtime = runtime_from_url(url)
    try:
        await runtime.open()
        audit, budget = governance(runtime, model)
        page = await audit.query(user_id=USER, session_id=session, limit=500)
        trail = []
        for entry in page.entries:
            detail = entry.payload.get("tool") or entry.payload.get("outcome") or ""
            trail.append(f"#{entry.seq:<3} {entry.action:<16} {detail}")
        report = await audit.verify(user_id=USER)
        trail.append(f"chain verified: {'ok' if report.ok else 'PROBLEMS FOUND'}")
        cap = next(c for c in await budget.status(USER) if c.cap == "user.tokens_total")
        return trail, _Budget(cap.used, cap.reserved, float(TOKEN_CAP))
    finally:
        await runtime.close()
