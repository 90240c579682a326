"""``loomflow worker APP``: a process that recovers orphaned runs, with health and metrics.

``APP`` is ``module:attribute`` naming a mapping of agent names to agents, or a plain function
of no arguments returning one. The recoverer uses the journal of the agents (the first one's
runtime; every agent must journal to that database) and the first one's audit log. It takes
no ``--url``; a ``LOOMFLOW_RUNTIME_URL`` naming another journal than the agents' is refused,
so the worker never sweeps a journal other than the one the other commands read. It sweeps
at start and then every ``--interval`` seconds, serves ``/metrics`` (prometheus-client's default
registry), ``/healthz`` and ``/readyz`` (200 once a sweep has reached the journal) on
``--host``:``--port``, and on SIGTERM or SIGINT stops taking work, releases the leases of the
runs it is resuming (another worker takes them over at once) and exits 0.

``--once``: one sweep, wait for the runs it resumed, exit: 0 when all of them finished (or were
cancelled), 1 when one of them raised (it is retried, or dead-lettered, by a later sweep).

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
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from ..agent import Agent
from ..audit import AuditLog
from ..config import Settings, _masked_url
from ..errors import ConfigurationError, UserError
from ..recovery import Recovery, SweepReport
from ..runtime import JournalRuntime
from ..runtime._identity import journal_identity
from ..storage import PostgresDatabase, SqliteDatabase
from ..stores import Stores
from ._format import port, positive_int, who

__all__ = ["load_app", "register"]

log = logging.getLogger("loomflow.worker")


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
    worker.add_argument("--worker-id", help="name in the audit log (default: host:pid)")
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


def load_app(spec: str) -> dict[str, Agent]:
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
        raise UserError(f"APP {spec!r}: cannot import module {module_name!r} ({exc})") from exc
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
            raise UserError(f"APP {spec!r}: the factory must be a plain function, not async")
    if not isinstance(target, Mapping) or not target:
        raise UserError(
            f"APP {spec!r} must be a non-empty mapping of agent names to agents (or a function "
            f"returning one), not {type(target).__name__}"
        )
    agents: dict[str, Agent] = {}
    for name, agent in target.items():
        if not isinstance(name, str) or not isinstance(agent, Agent):
            raise UserError(
                f"APP {spec!r}: entry {name!r} must map a name to a loomflow Agent, not "
                f"{type(agent).__name__}"
            )
        agents[name] = agent
    return agents


class _Health:
    """What /healthz and /readyz answer: alive while serving; ready once the store answered."""

    def __init__(self) -> None:
        self.ready = False


def _serve(host: str, port: int, health: _Health) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._answer(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._answer(200, b"ok\n")
            elif path == "/readyz":
                if health.ready:
                    self._answer(200, b"ready\n")
                else:
                    self._answer(503, b"not ready: the journal has not answered yet\n")
            else:
                self._answer(404, b"not found\n")

        def _answer(self, status: int, body: bytes, kind: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None  # scrapes every few seconds would flood the log

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:  # port taken, address not on this host, no permission
        raise ConfigurationError(
            f"cannot serve /metrics, /healthz and /readyz on {host}:{port}: {exc.strerror or exc}"
            " (choose another --port or --host)"
        ) from exc
    server.daemon_threads = True
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
    for ref in report.unregistered:
        print(f"  left alone: session {ref.session_id!r} of {who(ref.user_id)}: {ref.reason}")
    for ref in report.dead_lettered:
        print(f"  dead letter: session {ref.session_id!r} of {who(ref.user_id)}: {ref.reason}")


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


async def _handle(args: argparse.Namespace) -> int:
    agents = load_app(args.app)
    first = next(iter(agents.values()))
    runtime = first.runtime
    if runtime is None:
        raise UserError(f"agent {first.name!r} has no runtime: there is no journal to recover")
    try:
        await _check_settings_journal(runtime, args.app)
        return await _recover(args, agents, runtime)
    finally:
        await runtime.close()


async def _recover(
    args: argparse.Namespace, agents: dict[str, Agent], runtime: JournalRuntime
) -> int:
    """Sweep once, or serve and sweep until stopped (the caller closes the runtime)."""
    first = next(iter(agents.values()))
    audit = first.audit if isinstance(first.audit, AuditLog) else None
    recovery = Recovery(
        runtime,
        agents,
        max_attempts=args.max_attempts,
        interval=args.interval,
        worker_id=args.worker_id,
        audit=audit,
        concurrency=args.concurrency,
    )
    health = _Health()
    port = args.port if args.port is not None else (None if args.once else 9464)
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
    try:
        if args.once:
            report = await recovery.sweep()
            health.ready = True
            _print(report, args.json)
            await recovery.wait()
            return 1 if recovery.failures else 0
        return await _serve_forever(recovery, health, args.json)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


async def _serve_forever(recovery: Recovery, health: _Health, as_json: bool) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _event(
        as_json,
        "started",
        f"worker {recovery.worker_id} started: a sweep every {recovery.interval:g}s",
        worker=recovery.worker_id,
    )
    try:
        while not stop.is_set():
            try:
                report = await recovery.sweep()
                health.ready = True
                if report.resumed or report.dead_lettered or report.unregistered:
                    _print(report, as_json)
            except Exception:
                health.ready = False
                log.warning("sweep failed; trying again in %gs", recovery.interval, exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), recovery.interval)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    await recovery.stop()
    _event(
        as_json,
        "stopped",
        f"worker {recovery.worker_id} stopped: the runs it held are handed over",
        worker=recovery.worker_id,
    )
    sys.stdout.flush()
    return 0
