"""``loomflow worker APP``: a process that recovers orphaned runs, with health and metrics.

``APP`` is ``module:attribute`` naming a mapping of agent names to agents, or a plain function
of no arguments returning one. The recoverer uses the journal of the agents (the first one's
runtime; every agent must journal to that database) and the first one's audit log. It takes
no ``--url``; a ``LOOMFLOW_RUNTIME_URL`` naming another journal than the agents' is refused,
so the worker never sweeps a journal other than the one the other commands read. It sweeps
at start and then every ``--interval`` seconds, serves ``/metrics`` (prometheus-client's default
registry), ``/healthz`` (200 while its event loop runs) and ``/readyz`` (200 once a sweep has
reached the journal) on ``--host``:``--port``, and on SIGTERM or SIGINT fails ``/readyz``,
stops taking work, releases the leases of the runs it is resuming (another worker takes them
over at once) and exits 0.

A sweep still running after ``--sweep-timeout`` seconds (by default the lease,
``LOOMFLOW_LEASE_SECONDS``) is cancelled and counts as failed: a journal that accepts
connections and then never answers makes ``/readyz`` answer 503 and a warning saying so,
instead of a worker that looks ready and does nothing. A signal cancels a sweep in flight, and
handing the runs over at shutdown (then closing the journal) waits at most
:data:`_HANDOVER_MAX_S` seconds each (or the sweep timeout, when shorter); runs not handed over
by then are named in a warning and taken over once their lease runs out.

``--once``: one sweep, wait for the runs it resumed, exit: 0 when all of them finished (or were
cancelled), 1 when one of them raised (it is retried, or dead-lettered, by a later sweep) or
the sweep failed. SIGTERM and SIGINT hand its runs over and exit 0 there too.

What it prints is plain text; with ``--json``, one JSON object a line: its events (``serving``,
``started``, ``stopped``) and its sweep reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from .._ids import check_id
from ..agent import Agent
from ..agent.architectures import Debate, Workflow, team_hint
from ..audit import AuditLog
from ..config import Settings, _masked_url
from ..errors import (
    ConfigurationError,
    InvalidIdError,
    LoomflowError,
    StoreUnavailableError,
    UserError,
)
from ..recovery import Recoverable, Recovery, RunRef, SweepReport
from ..runtime import JournalRuntime
from ..runtime._identity import journal_identity
from ..storage import PostgresDatabase, SqliteDatabase
from ..stores import Stores
from ..telemetry import TelemetrySetup
from ..tools._tool import tool_threads_running
from ._format import exception_line, port, positive_int, printable, who

__all__ = ["load_app", "register"]

log = logging.getLogger("loomflow.worker")

_HANDOVER_MAX_S = 5.0
"""At shutdown, the longest wait for the runs to be handed over, and then for the journal to
close (each; the sweep timeout when that is shorter). Handing over is a few writes, done in
milliseconds; a database that does not answer would otherwise keep the worker from exiting."""


_STALL_MIN_S = 5.0
"""The shortest time the event loop may go without running before /healthz fails."""


def register(subparsers: Any) -> None:
    """Add the ``worker`` command to the CLI."""
    worker = subparsers.add_parser(
        "worker", help="recover orphaned runs: sweep, resume, serve /metrics /healthz /readyz"
    )
    worker.add_argument(
        "app", help="module:attribute, a mapping of agent names to agents or a factory of one"
    )
    worker.add_argument("--once", action="store_true", help="one sweep, wait, exit")
    worker.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1)")
    worker.add_argument(
        "--port", type=port, default=None, help="HTTP port (9464; 0 picks one; --once: none)"
    )
    worker.add_argument(
        "--interval",
        type=_seconds,
        help="seconds between sweeps (LOOMFLOW_RECOVERY_INTERVAL_SECONDS, 10)",
    )
    worker.add_argument(
        "--max-attempts",
        type=positive_int,
        help="claims before a run is failed (LOOMFLOW_RECOVERY_MAX_ATTEMPTS, 5)",
    )
    worker.add_argument(
        "--concurrency", type=positive_int, default=10, help="runs resumed at once (10)"
    )
    worker.add_argument(
        "--sweep-timeout",
        type=_seconds,
        help="a sweep still running after this many seconds is cancelled and counts as failed "
        "(LOOMFLOW_LEASE_SECONDS, 30)",
    )
    worker.add_argument(
        "--worker-id",
        type=_worker_id,
        help="name in the audit log and logs: at most 256 bytes, no control characters "
        "(default: host:pid)",
    )
    worker.add_argument(
        "--json", action="store_true", help="events and sweep reports as JSON lines"
    )
    worker.set_defaults(handler=_handle)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def _worker_id(text: str) -> str:
    """``--worker-id`` as an argparse type: the id rules, as every id (it names the worker
    in log lines and audit actors, where a control character would forge or garble them)."""
    try:
        check_id("worker_id", text)
    except InvalidIdError as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None
    return text


def load_app(spec: str) -> dict[str, Recoverable]:
    """The agents ``module:attribute`` names (a mapping, or a factory returning one).

    Raises:
        UserError: the spec is malformed, the module or attribute is missing, or it is not
            (and does not return) a mapping of names to agents.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UserError(f"APP must be module:attribute (e.g. myapp.workers:AGENTS), not {spec!r}")
    # The application's package may sit in the directory the worker starts in (an installed
    # console script's sys.path does not hold it). Looked in last, not first as `python -m`
    # does: a stray file there must not shadow the standard library or an installed package.
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        parts = module_name.split(".")
        if exc.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            # The module was found; something it imports is missing (a dependency).
            raise UserError(
                f"APP {spec!r}: importing {module_name!r} failed: {exc} (install what it needs "
                "where the worker runs)"
            ) from exc
        raise UserError(
            f"APP {spec!r}: cannot import module {module_name!r} ({exc}); it is looked for "
            f"among the installed packages and in the directory the worker starts in ({here}): "
            "start the worker in your application's directory, or install the application"
        ) from exc
    except Exception as exc:  # the application's own import failed: say so in one line
        raise UserError(
            f"APP {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UserError(
                f"APP {spec!r}: {module_name!r} has no attribute {attribute!r}"
            ) from None
    if callable(target) and not isinstance(target, Mapping):
        try:
            target = target()
        except Exception as exc:
            raise UserError(
                f"APP {spec!r}: the factory raised {type(exc).__name__}: {exc}"
            ) from exc
        if inspect.isawaitable(target):
            if inspect.iscoroutine(target):
                target.close()  # never run: no "coroutine was never awaited" warning after ours
            raise UserError(f"APP {spec!r}: the factory must be a plain function, not async")
    if not isinstance(target, Mapping) or not target:
        raise UserError(
            f"APP {spec!r} must be a non-empty mapping of agent names to agents (or a function "
            f"returning one), not {type(target).__name__}"
        )
    agents: dict[str, Recoverable] = {}
    for name, agent in target.items():
        if not isinstance(name, str) or not isinstance(agent, Agent | Debate | Workflow):
            raise UserError(
                f"APP {spec!r}: entry {name!r} must map a name to a loomflow Agent, Debate or "
                f"Workflow, not {type(agent).__name__}{team_hint(agent)}"
            )
        agents[name] = agent
    return agents


class _Health:
    """What /healthz and /readyz answer: alive while the worker's event loop runs; ready
    while the last sweep reached the journal, and otherwise why not (one line).

    The HTTP server runs in a thread of its own, so it answers even when a blocking call (in
    a tool, a hook, the application's code) holds the event loop, and nothing sweeps, renews
    a lease or handles a signal: the loop marks :attr:`beat` every second (:meth:`pulse`),
    and a beat older than ``stall_s`` fails both probes.
    """

    def __init__(self, stall_s: float) -> None:
        # One tuple, replaced whole: the HTTP threads read it while the loop writes it.
        self.state: tuple[bool, str] = (False, "the journal has not answered yet")
        self.stall_s = stall_s
        self.beat = time.monotonic()
        self.stopping = False  # a signal came: the worker hands its runs over and exits

    def ready(self) -> None:
        self.state = (True, "ready")

    def failed(self, why: str) -> None:
        self.state = (False, why)

    def stalled(self) -> str | None:
        """Why the worker is not alive (its event loop has not run for too long), or None."""
        silent = time.monotonic() - self.beat
        if silent <= self.stall_s:
            return None
        return (
            f"the worker's event loop has not run for {silent:.0f}s (a blocking call in a "
            "tool, a hook or the application holds it): nothing is swept, no lease renewed"
        )

    async def pulse(self) -> None:
        """Mark the loop alive every second, until cancelled."""
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(min(1.0, self.stall_s / 4))


# A client that gave up (a probe's timeout ran out while the worker was slow to answer).
_DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to stderr for anything a handler raised.
        exc = sys.exc_info()[1]
        if isinstance(exc, _DISCONNECTS):
            return  # the client went away: nothing is wrong with the worker
        log.warning("answering an HTTP request failed", exc_info=True)


_TEXT = "text/plain; charset=utf-8"


def _serve(host: str, port: int, health: _Health) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(*self._route())

        def do_HEAD(self) -> None:
            # Probes and load balancers often check with HEAD: the same status and headers
            # as GET, without the body (501 before).
            self._answer(*self._route(), head=True)

        def _route(self) -> tuple[int, bytes, str]:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                return 200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST
            if path == "/healthz":
                stalled = health.stalled()
                if stalled is None:
                    return 200, b"ok\n", _TEXT
                return 503, f"not alive: {stalled}\n".encode(), _TEXT
            if path == "/readyz":
                ready, why = health.state
                stalled = health.stalled()
                if stalled is not None:
                    return 503, f"not ready: {stalled}\n".encode(), _TEXT
                if health.stopping:
                    return 503, b"not ready: the worker is stopping (SIGTERM or SIGINT)\n", _TEXT
                if ready:
                    return 200, b"ready\n", _TEXT
                return 503, f"not ready: {why}\n".encode(), _TEXT
            return 404, b"not found\n", _TEXT

        def _answer(self, status: int, body: bytes, kind: str, *, head: bool = False) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)
            except _DISCONNECTS:
                self.close_connection = True  # the client gave up waiting: nobody to tell

        def log_message(self, format: str, *args: Any) -> None:
            return None  # scrapes every few seconds would flood the log

    try:
        server = _Server((host, port), Handler)
    except OSError as exc:  # port taken, address not on this host, no permission
        raise ConfigurationError(
            f"cannot serve /metrics, /healthz and /readyz on {host}:{port}: {exc.strerror or exc}"
            " (choose another --port or --host)"
        ) from exc
    threading.Thread(target=server.serve_forever, name="loomflow-worker-http", daemon=True).start()
    return server


def _summary(report: SweepReport) -> dict[str, Any]:
    def refs(items: list[Any]) -> list[dict[str, Any]]:
        return [
            {"session_id": r.session_id, "user_id": r.user_id, "agent": r.agent, "reason": r.reason}
            for r in items
        ]

    return {
        "resumed": refs(report.resumed),
        "unregistered": refs(report.unregistered),
        "dead_lettered": refs(report.dead_lettered),
        "claim_lost": refs(report.claim_lost),
        "deferred": refs(report.deferred),
        "states": report.states,
    }


def _print(report: SweepReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps(_summary(report)), flush=True)
        return
    print(
        f"sweep: resumed {len(report.resumed)}, left alone {len(report.unregistered)}, "
        f"dead-lettered {len(report.dead_lettered)}, lost to another worker "
        f"{len(report.claim_lost)}, deferred {len(report.deferred)}",
        flush=True,
    )
    # A reason quotes the run's last error, read from the journal: shown escaped.
    for ref in report.unregistered:
        print(f"  left alone: {_named(ref)}: {printable(ref.reason)}")
    for ref in report.dead_lettered:
        print(f"  dead letter: {_named(ref)}: {printable(ref.reason)}")


def _event(as_json: bool, event: str, text: str, **fields: Any) -> None:
    """One line about the worker itself: ``text`` for people, an object with ``--json``."""
    print(json.dumps({"event": event, **fields}) if as_json else text, flush=True)


def _where(runtime: JournalRuntime) -> str:
    """Where a runtime journals, for a message (a password in a DSN hidden)."""
    database = getattr(runtime, "database", None)
    if isinstance(database, SqliteDatabase):
        return f"the SQLite file {database.path}"
    if isinstance(database, PostgresDatabase):
        return database.shown_dsn or "a PostgreSQL pool"
    return repr(runtime)


async def _check_settings_journal(runtime: JournalRuntime, spec: str) -> None:
    """Refuse a ``LOOMFLOW_RUNTIME_URL`` naming another journal than the agents' own.

    The worker recovers the agents' journal: with the variable naming another one, ``runs
    list`` and the other commands would read one journal while the worker swept another,
    and orphans would seem to stay orphaned. Unset, the variable names nothing to compare.
    """
    settings = Settings()
    url = settings.runtime_url
    if "runtime_url" not in settings.model_fields_set or url.startswith("memory:"):
        return  # a memory:// journal is private to the object that made it: nothing to match
    async with Stores(settings) as stores:
        named = stores.runtime
        assert named is not None  # Stores builds the journal unless told not to
        same = await journal_identity(named) == await journal_identity(runtime)
    if not same:
        raise ConfigurationError(
            f"LOOMFLOW_RUNTIME_URL names {_masked_url(url)} but the agents of {spec} journal "
            f"to {_where(runtime)}: the worker recovers the agents' journal, not the one the "
            "other commands read; point both at one journal (Agent.from_settings takes the "
            "variable) or unset it for the worker"
        )


def _export_spans() -> TelemetrySetup | None:
    """Span (and OTel metric) export of the runs this worker resumes, from the ``OTEL_*`` and
    ``LOOMFLOW_OTLP_*`` settings, as ``setup_telemetry()`` does in an application: unless the
    app module set telemetry up itself (or installed a tracer provider of its own). The worker
    serves ``/metrics`` on ``--port`` itself, so ``LOOMFLOW_METRICS_PORT`` is not used."""
    from opentelemetry import trace

    from ..telemetry import setup_requested, setup_telemetry
    from ..telemetry._setup import already_set_up

    if already_set_up() or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None
    settings = Settings().model_copy(update={"metrics_port": None})
    return setup_telemetry(settings) if setup_requested(settings) else None


async def _handle(args: argparse.Namespace) -> int:
    agents = load_app(args.app)
    exporting = _export_spans()
    try:
        code = await _handle_agents(args, agents)
    finally:
        if exporting is not None:
            exporting.shutdown()  # the spans still buffered
    if running := tool_threads_running():
        # A sync tool's body runs in a thread that no cancel stops, and asyncio's shutdown
        # would wait for it: the step went on here, beside the same step started again by the
        # worker that took its run over, and the worker exited whenever the body returned.
        # Handed over means abandoned, as after a crash: the body ends with the process.
        log.warning(
            "%d sync tool call(s) were still running in threads (of a run handed over, or past "
            "the tool's timeout); exiting without waiting for them: a handed-over run's call "
            "runs again on the worker that takes the run over, as after a crash",
            running,
        )
        _exit_now(code)
    return code


async def _handle_agents(args: argparse.Namespace, agents: dict[str, Recoverable]) -> int:
    first = next(iter(agents.values()))
    runtime = first.runtime
    if runtime is None:
        raise UserError(f"agent {first.name!r} has no runtime: there is no journal to recover")
    if args.sweep_timeout is None:
        args.sweep_timeout = Settings().lease_seconds
    wait = min(_HANDOVER_MAX_S, args.sweep_timeout)
    shutdown = _Shutdown()
    try:
        await _check_settings_journal(runtime, args.app)
        code = await _recover(args, agents, runtime, shutdown)
    except BaseException as exc:
        if not await _close(runtime, wait) or shutdown.hung:
            if isinstance(exc, LoomflowError):  # said as main() says it, then gone
                print(f"loomflow: error: {printable(exc)}", file=sys.stderr)
                _exit_now(1)
            if isinstance(exc, Exception):
                _exit_now(1)
        raise
    if not await _close(runtime, wait) or shutdown.hung:
        _exit_now(code)
    return code


class _Shutdown:
    """Whether the worker leaves work behind that waits on a database that does not answer
    (a run not handed over, a cancelled sweep still waiting, the journal not closed)."""

    hung = False


def _exit_now(code: int) -> NoReturn:
    """End the process without asyncio's own shutdown, which cancels every task left and
    waits for each to end: a statement of asyncpg's that is cancelled waits for the server,
    so with the database not answering that wait never ends (and a run cancelled there tries
    to hand itself over again). What was left behind has been said; the database sees the
    connections close, as after a SIGKILL, and the leases of the runs not handed over run
    out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _close(runtime: JournalRuntime, seconds: float) -> bool:
    """Close the journal, but do not wait forever on a database that stopped answering (its
    connections go with the process): whether it closed in time."""
    closing = asyncio.create_task(runtime.close())
    # asyncio.wait, not wait_for: on a timeout, wait_for waits for the cancelled close too.
    await asyncio.wait({closing}, timeout=seconds)
    if closing.done():
        closing.result()
        return True
    closing.cancel()
    log.warning(
        "the journal's connections did not close within %gs (the database does not "
        "answer); exiting without them",
        seconds,
    )
    return False


class _Sweeper:
    """Sweeps bounded in time, and cut short by a signal.

    A sweep still running after ``timeout`` seconds is cancelled and reported as a
    ``TimeoutError``: a database that accepts connections and never answers would otherwise
    hold it forever, the worker looking ready all along. A cancelled statement of asyncpg's
    pool waits for the server before it ends, so a cancelled sweep may linger; no other one
    starts until it has ended (each would hang the same way and hold a connection).
    """

    def __init__(self, recovery: Recovery, stop: asyncio.Event, timeout: float) -> None:
        self.recovery = recovery
        self.stop = stop
        self.timeout = timeout
        self._stuck: asyncio.Task[SweepReport] | None = None
        self._stuck_since = 0.0
        self.left: list[RunRef] = []  # the runs not handed over at shutdown

    @property
    def hung(self) -> bool:
        """Whether work is left waiting on the database: a cancelled sweep, a run."""
        return bool(self.left) or (self._stuck is not None and not self._stuck.done())

    async def sweep(self) -> SweepReport | None:
        """One sweep's report, or ``None`` when a signal came first (the sweep is cancelled).

        Raises:
            TimeoutError: the sweep overran its time (or the previous one has not ended).
            Exception: whatever the sweep raised.
        """
        loop = asyncio.get_running_loop()
        if self._stuck is not None:
            if not self._stuck.done():
                self.recovery.metrics.store_unavailable("journal")
                raise TimeoutError(
                    f"the journal has not answered for {loop.time() - self._stuck_since:.0f}s: "
                    "the sweep cancelled then has not ended yet"
                )
            self._stuck = None
        started = loop.time()
        task = asyncio.create_task(self.recovery.sweep(), name="loomflow-worker-sweep")
        stopped = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait(
                {task, stopped}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopped.cancel()
        if task.done():
            return task.result()
        task.cancel()
        task.add_done_callback(_retrieve)
        await asyncio.wait({task}, timeout=0.1)  # most statements end at once when cancelled
        if not task.done():
            self._stuck, self._stuck_since = task, started
        if self.stop.is_set():
            return None
        # A journal that does not answer is a failed store, as one that refuses (the sweep
        # counts that): LoomflowStoreUnavailable fires on both.
        self.recovery.metrics.store_unavailable("journal")
        raise TimeoutError(
            f"the sweep did not finish within {self.timeout:g}s (--sweep-timeout): the journal "
            "did not answer in time"
        )


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Read a cancelled sweep's outcome, so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


async def _recover(
    args: argparse.Namespace,
    agents: dict[str, Recoverable],
    runtime: JournalRuntime,
    shutdown: _Shutdown,
) -> int:
    """Sweep once, or serve and sweep until stopped (the caller closes the runtime)."""
    # The first agent's audit log (a debate or workflow has none of its own).
    first = next((a for a in agents.values() if isinstance(a, Agent)), None)
    audit = first.audit if first is not None and isinstance(first.audit, AuditLog) else None
    recovery = Recovery(
        runtime,
        agents,
        max_attempts=args.max_attempts,
        interval=args.interval,
        worker_id=args.worker_id,
        audit=audit,
        concurrency=args.concurrency,
    )
    # A loop held longer than a sweep may take is a worker that does nothing (not less than
    # _STALL_MIN_S: a busy host's pauses are no reason to restart it).
    health = _Health(stall_s=max(_STALL_MIN_S, args.sweep_timeout))
    # SIGTERM and SIGINT, from here on, in both modes: stop sweeping, hand the runs over,
    # and not ready from the signal on (a sweep ending meanwhile does not make it ready).
    stop = asyncio.Event()

    def stopping() -> None:
        health.stopping = True
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping)
    sweeper = _Sweeper(recovery, stop, args.sweep_timeout)
    port = args.port if args.port is not None else (None if args.once else 9464)
    server = None
    pulse = asyncio.create_task(health.pulse(), name="loomflow-worker-pulse")
    try:
        server = _serve(args.host, port, health) if port is not None else None
        if server is not None:
            bound = server.server_address[1]
            _event(
                args.json,
                "serving",
                f"serving /metrics, /healthz and /readyz on http://{args.host}:{bound}",
                host=args.host,
                port=bound,
            )
        if args.once:
            code = await _once(sweeper, health, args.json)
            if code is not None:
                return code
        else:
            await _serve_forever(sweeper, health, args.json)
        await _hand_over(sweeper, args.json)
        return 0
    finally:
        pulse.cancel()
        shutdown.hung = sweeper.hung
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if server is not None:
            server.shutdown()
            server.server_close()


async def _once(sweeper: _Sweeper, health: _Health, as_json: bool) -> int | None:
    """One sweep, then wait for the runs it resumed: the exit code, or ``None`` when a signal
    came first (the caller hands the runs over)."""
    recovery = sweeper.recovery
    try:
        report = await sweeper.sweep()
    except Exception as exc:
        # Runs it claimed before it failed are resuming: give them back before exiting 1.
        await _give_back(sweeper)
        if isinstance(exc, TimeoutError):
            raise StoreUnavailableError(str(exc)) from exc
        raise
    if report is None:
        return None
    health.ready()
    _print(report, as_json)
    finished = asyncio.create_task(recovery.wait())
    stopped = asyncio.create_task(sweeper.stop.wait())
    try:
        await asyncio.wait({finished, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Not `finished`: cancelling a wait() cancels the runs too, and the hand-over does
        # that itself, once (a second cancel would interrupt a run handing itself over).
        stopped.cancel()
    if sweeper.stop.is_set() and recovery.active:
        return None
    return 1 if recovery.failures else 0


async def _serve_forever(sweeper: _Sweeper, health: _Health, as_json: bool) -> None:
    """Sweep every interval until a signal (the caller hands the runs over)."""
    recovery = sweeper.recovery
    _event(
        as_json,
        "started",
        f"worker {printable(recovery.worker_id)} started: a sweep every {recovery.interval:g}s",
        worker=recovery.worker_id,
    )
    while not sweeper.stop.is_set():
        try:
            report = await sweeper.sweep()
        except Exception as exc:
            health.failed(f"the last sweep failed: {exception_line(exc)}")
            log.warning("sweep failed (trying again in %gs)", recovery.interval, exc_info=True)
        else:
            if report is None:
                break
            health.ready()
            if report.resumed or report.dead_lettered or report.unregistered:
                _print(report, as_json)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sweeper.stop.wait(), recovery.interval)


async def _hand_over(sweeper: _Sweeper, as_json: bool) -> None:
    """Give back the runs in progress and say so (the ``stopped`` event)."""
    recovery = sweeper.recovery
    left = await _give_back(sweeper)
    name = printable(recovery.worker_id)
    if left:
        text = (
            f"worker {name} stopped: {len(left)} run(s) it held could not be handed over "
            "and are taken over once their lease runs out"
        )
    else:
        text = f"worker {name} stopped: the runs it held are handed over"
    _event(
        as_json,
        "stopped",
        text,
        worker=recovery.worker_id,
        not_handed_over=[{"session_id": r.session_id, "user_id": r.user_id} for r in left],
    )
    sys.stdout.flush()


async def _give_back(sweeper: _Sweeper) -> list[RunRef]:
    """Stop the runs in progress and give their leases back, waiting at most
    :data:`_HANDOVER_MAX_S` (each hand-over writes to the journal); the runs not handed
    over, named in a warning."""
    recovery, seconds = sweeper.recovery, min(_HANDOVER_MAX_S, sweeper.timeout)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await recovery.stop()
    sweeper.left = left = recovery.resuming
    if left:
        log.warning(
            "%d run(s) not handed over within %gs (the journal did not answer); another "
            "worker takes them over once their lease runs out: %s",
            len(left),
            seconds,
            ", ".join(_named(ref) for ref in left),
        )
    return left


def _named(ref: RunRef) -> str:
    return f"session {ref.session_id!r} of {who(ref.user_id)}"
