"""What ``runtime.step()`` costs on each backend, next to the raw database floor.

For a ~200-byte result this measures, per step:

* fresh (miss): a new run per batch, distinct step names, each step journaled;
* hit (replay): the same run opened again, every step answered from the journal;
* the floor, through the same driver in the same process run: SQLite is one INSERT + COMMIT
  through aiosqlite on a table shaped like ``loom_entries`` with the same pragmas (WAL,
  ``synchronous=FULL``), timed both as ``execute`` + ``commit`` and as one autocommitted
  ``execute_fetchall``, the cheaper being the floor; PostgreSQL is one autocommitted INSERT
  through the asyncpg pool and on a bare connection, the cheaper being the floor; a
  primary-key SELECT is the read floor on both;
* resume: opening a 1,000-step run (lease claim plus its single load query) and replaying
  all 1,000 steps;
* telemetry, which is on by default: the per-step cost of the default telemetry (step span
  and OTel metric instruments through the OpenTelemetry API with no SDK installed, so no-ops;
  Prometheus counters on the default registry) against ``telemetry=False``, in memory, on
  ``runtime.step()`` and on whole agent runs, batches alternating; and, apart, what the no-op
  OTel metrics add (the default against the same telemetry with ``Metrics(otel=False)``).

Batches of fresh steps and of floor inserts alternate, so both see the same disk and cache
state; each figure is the median over batches of the mean per step.

Targets: fresh <= 1.15x the insert floor on SQLite at ``synchronous=FULL`` (the default),
<= 1.5x at ``synchronous=NORMAL`` (the floor then at NORMAL too), <= 1.2x on PostgreSQL;
hit <= 25 us/step; resume of 1,000 steps <= 100 ms.

Run it:

    python benchmarks/runtime_overhead.py
    python benchmarks/runtime_overhead.py --steps 500 --batches 9 --pg-dsn postgresql://...
    python benchmarks/runtime_overhead.py --skip-postgres --profile

PostgreSQL work happens in a scratch database that the script creates and drops.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiosqlite
from ulid import ULID

from loomflow.runtime import (
    InMemoryRuntime,
    JournalRuntime,
    PostgresRuntime,
    SqliteRuntime,
    codec,
)

# The server the test suite uses (tests/conftest.py), so a bare run needs no flags.
PG_DSN = os.environ.get("LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")

USER = "bench-user"
# x the insert floor, per backend row (issue 17)
FRESH_TARGETS = {"sqlite": 1.15, "sqlite-normal": 1.5, "postgres": 1.2}
HIT_TARGET_US = 25.0
RESUME_TARGET_MS = 100.0


class _KeepOpen(Exception):
    """Raised at the end of a run so it stays open and can be replayed."""


def make_payload(size: int) -> dict[str, Any]:
    """A dict whose journal encoding is exactly ``size`` bytes (for sizes >= ~30)."""
    value: dict[str, Any] = {"role": "assistant", "text": ""}
    base = len(codec.dumps(value))
    value["text"] = "x" * max(0, size - base)
    return value


# -- the journal -----------------------------------------------------------------------------

FloorOp = Callable[[int], Awaitable[Any]]


async def fresh_batch(
    runtime: JournalRuntime,
    session: str,
    n: int,
    produce: Callable[[], Any],
    floor_ops: dict[str, FloorOp],
) -> tuple[list[float], dict[str, list[float]]]:
    """Journal n fresh steps in a new run, each beside one raw insert of every floor variant.

    Returns the seconds of each step call and of each floor insert. Pairing them call by call
    keeps the ratio honest on a shared machine: a noisy neighbour slows both alike. The run is
    left open (it raises) so that :func:`hit_batch` can replay it.
    """
    steps: list[float] = []
    floors: dict[str, list[float]] = {name: [] for name in floor_ops}
    clock = time.perf_counter
    try:
        async with runtime.session(session, USER) as run:
            gc.collect()
            names = [*floor_ops, None]  # None: the step
            for i in range(n):
                # Each call takes each place in turn: a commit right after another file's
                # fsync is not the one that follows the same file's, and neither side should
                # always get the same seat.
                shift = i % len(names)
                for name in names[shift:] + names[:shift]:
                    t0 = clock()
                    if name is None:
                        await runtime.step(f"step-{i}", produce)
                        steps.append(clock() - t0)
                    else:
                        await floor_ops[name](i)
                        floors[name].append(clock() - t0)
            assert run.stats.misses == n
            raise _KeepOpen
    except _KeepOpen:
        pass
    return steps, floors


def _must_not_run() -> Any:
    raise AssertionError("a replayed step ran its function")


async def hit_batch(runtime: JournalRuntime, session: str, n: int) -> float:
    """Re-enter the run left open by :func:`fresh_batch`; time only the n replayed steps."""
    async with runtime.session(session, USER) as run:
        gc.collect()
        t0 = time.perf_counter()
        for i in range(n):
            await runtime.step(f"step-{i}", _must_not_run)
        elapsed = time.perf_counter() - t0
        assert run.stats.hits == n
    return elapsed / n


@dataclass
class Resume:
    open_ms: float
    hits_ms: float

    @property
    def total_ms(self) -> float:
        return self.open_ms + self.hits_ms


async def build_run(
    runtime: JournalRuntime, session: str, n: int, produce: Callable[[], Any]
) -> None:
    try:
        async with runtime.session(session, USER):
            for i in range(n):
                await runtime.step(f"step-{i}", produce)
            raise _KeepOpen
    except _KeepOpen:
        pass


async def resume_once(runtime: JournalRuntime, session: str, n: int) -> Resume:
    """Open the (still open) run and replay all n steps; leave it open again."""
    t0 = time.perf_counter()
    opened = hits_done = t0
    try:
        async with runtime.session(session, USER) as run:
            opened = time.perf_counter()
            for i in range(n):
                await runtime.step(f"step-{i}", _must_not_run)
            hits_done = time.perf_counter()
            assert run.stats.hits == n
            raise _KeepOpen
    except _KeepOpen:
        pass
    return Resume((opened - t0) * 1e3, (hits_done - opened) * 1e3)


# -- the floors ------------------------------------------------------------------------------

# Same columns, key and index as loom_entries, so the floor writes the same amount per row.
_FLOOR_DDL = (
    """CREATE TABLE IF NOT EXISTS bench_floor (
        scope TEXT NOT NULL, epoch {bigint} NOT NULL, path TEXT NOT NULL, name TEXT NOT NULL,
        fingerprint TEXT NOT NULL, kind TEXT NOT NULL, format TEXT NOT NULL,
        codec_version INTEGER NOT NULL, value {blob} NOT NULL, size INTEGER NOT NULL,
        seq INTEGER NOT NULL, created_at {double} NOT NULL,
        PRIMARY KEY (scope, epoch, path, name, fingerprint))""",
    "CREATE INDEX IF NOT EXISTS bench_floor_created ON bench_floor (created_at)",
)
_FLOOR_COLUMNS = (
    "scope, epoch, path, name, fingerprint, kind, format, codec_version, value, size, seq, "
    "created_at"
)
_FLOOR_READ_WHERE = (
    "scope = {0}1 AND epoch = {0}2 AND path = {0}3 AND name = {0}4 AND fingerprint = {0}5"
)


def floor_rows(variant: str, batch: int, n: int, raw: bytes) -> list[tuple[Any, ...]]:
    """Rows shaped like journal entries (JSON scope, SHA-256-sized fingerprint)."""
    scope = f'["floor-{variant}-{batch}","{USER}"]'
    return [
        (scope, 0, "[]", f"step-{i}", f"{i:064x}", "step", "json", 1, raw, len(raw), i,
         time.time())
        for i in range(n)
    ]  # fmt: skip


class SqliteFloor:
    """Raw aiosqlite on a second file in the same directory, with the journal's pragmas."""

    def __init__(self, path: Path, synchronous: str = "FULL") -> None:
        self.path = path
        self.synchronous = synchronous
        self.tx: aiosqlite.Connection | None = None  # Python-managed transactions
        self.auto: aiosqlite.Connection | None = None  # isolation_level=None: autocommit

    async def _connect(self, isolation: str | None) -> aiosqlite.Connection:
        conn = await aiosqlite.connect(self.path, isolation_level=isolation)
        await conn.execute("PRAGMA busy_timeout = 5000")
        await conn.execute("PRAGMA journal_mode = WAL")
        await conn.execute(f"PRAGMA synchronous = {self.synchronous}")
        return conn

    async def open(self) -> None:
        self.auto = await self._connect(None)
        types = {"blob": "BLOB", "double": "REAL", "bigint": "INTEGER"}
        for ddl in _FLOOR_DDL:
            await self.auto.execute(ddl.format(**types))
        self.tx = await self._connect("")

    async def close(self) -> None:
        for conn in (self.tx, self.auto):
            if conn is not None:
                await conn.close()

    def insert_ops(self, batch: int, n: int, raw: bytes) -> dict[str, FloorOp]:
        tx, auto = self.tx, self.auto
        assert tx is not None
        assert auto is not None
        sql = f"INSERT INTO bench_floor ({_FLOOR_COLUMNS}) VALUES ({', '.join('?' * 12)})"
        tx_rows = floor_rows("tx", batch, n, raw)
        auto_rows = floor_rows("auto", batch, n, raw)

        async def execute_commit(i: int) -> None:
            await tx.execute(sql, tx_rows[i])  # opens the implicit transaction
            await tx.commit()

        async def execute_fetchall(i: int) -> None:
            await auto.execute_fetchall(sql, auto_rows[i])  # autocommits: one thread hop

        return {"execute+commit": execute_commit, "execute_fetchall": execute_fetchall}

    def select_op(self, batch: int, n: int, raw: bytes) -> FloorOp:
        auto = self.auto
        assert auto is not None
        sql = f"SELECT value FROM bench_floor WHERE {_FLOOR_READ_WHERE.format('?')}"
        keys = [row[:5] for row in floor_rows("auto", batch, n, raw)]

        async def select(i: int) -> Any:
            return await auto.execute_fetchall(sql, keys[i])

        return select


class PostgresFloor:
    """Raw asyncpg INSERTs, through the runtime's own pool and on a connection of their own.

    The journal runs its single statements on a connection outside the pool (its lane) while
    no other statement is on it, so the bare connection is a floor as fair as the pool: both
    are timed and the cheaper one is the floor.
    """

    def __init__(self, pool: Any, dsn: str) -> None:
        self.pool = pool
        self.dsn = dsn
        self.conn: Any = None

    async def open(self) -> None:
        import asyncpg

        types = {"blob": "BYTEA", "double": "DOUBLE PRECISION", "bigint": "BIGINT"}
        for ddl in _FLOOR_DDL:
            await self.pool.execute(ddl.format(**types))
        self.conn = await asyncpg.connect(self.dsn)

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()

    def insert_ops(self, batch: int, n: int, raw: bytes) -> dict[str, FloorOp]:
        placeholders = ", ".join(f"${i}" for i in range(1, 13))
        sql = f"INSERT INTO bench_floor ({_FLOOR_COLUMNS}) VALUES ({placeholders})"
        rows = floor_rows("auto", batch, n, raw)
        bare_rows = floor_rows("bare", batch, n, raw)
        pool, conn = self.pool, self.conn

        async def pooled(i: int) -> None:
            await pool.execute(sql, *rows[i])

        async def bare(i: int) -> None:
            await conn.execute(sql, *bare_rows[i])

        return {"pool.execute": pooled, "conn.execute": bare}

    def select_op(self, batch: int, n: int, raw: bytes) -> FloorOp:
        sql = f"SELECT value FROM bench_floor WHERE {_FLOOR_READ_WHERE.format('$')}"
        keys = [row[:5] for row in floor_rows("auto", batch, n, raw)]
        pool = self.pool

        async def select(i: int) -> Any:
            return await pool.fetchrow(sql, *keys[i])

        return select


# -- driver ----------------------------------------------------------------------------------


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Result:
    backend: str
    fresh: list[float] = field(default_factory=list)  # seconds per step call
    hit: list[float] = field(default_factory=list)  # mean seconds per step, one per batch
    floors: dict[str, list[float]] = field(default_factory=dict)  # seconds per insert
    read_floor: list[float] = field(default_factory=list)  # seconds per select
    resume: list[Resume] = field(default_factory=list)
    note: str = ""

    def floor(self) -> tuple[str, float] | None:
        """The cheaper insert variant by median, which the ratio is taken against."""
        if not self.floors:
            return None
        medians = {name: statistics.median(v) for name, v in self.floors.items()}
        name = min(medians, key=medians.__getitem__)
        return name, medians[name]


class Floor(Protocol):
    def insert_ops(self, batch: int, n: int, raw: bytes) -> dict[str, FloorOp]: ...

    def select_op(self, batch: int, n: int, raw: bytes) -> FloorOp: ...


async def measure(
    backend: str, runtime: JournalRuntime, args: argparse.Namespace, floor: Floor | None
) -> Result:
    payload = make_payload(args.payload)
    raw = codec.dumps(payload)

    def produce() -> dict[str, Any]:
        return payload

    result = Result(backend)
    prefix = str(ULID()).lower()
    n = args.steps
    # Batch 0 warms caches, prepared statements and the pool; it is not counted.
    for batch in range(args.batches + 1):
        session = f"{prefix}-batch-{batch}"
        ops = floor.insert_ops(batch, n, raw) if floor is not None else {}
        steps, floors = await fresh_batch(runtime, session, n, produce, ops)
        hit = await hit_batch(runtime, session, n)
        reads: list[float] = []
        if floor is not None:
            select = floor.select_op(batch, n, raw)
            for i in range(n):
                t0 = time.perf_counter()
                await select(i)
                reads.append(time.perf_counter() - t0)
        if batch == 0:
            continue
        result.fresh += steps
        result.hit.append(hit)
        for name, values in floors.items():
            result.floors.setdefault(name, []).extend(values)
        result.read_floor += reads

    session = f"{prefix}-resume"
    await build_run(runtime, session, args.resume_steps, produce)
    await resume_once(runtime, session, args.resume_steps)  # warm-up
    for _ in range(args.resume_reps):
        gc.collect()
        result.resume.append(await resume_once(runtime, session, args.resume_steps))
    return result


async def bench_memory(args: argparse.Namespace) -> Result:
    runtime = InMemoryRuntime()
    try:
        return await measure("memory", runtime, args, None)
    finally:
        await runtime.close()


async def bench_sqlite(
    args: argparse.Namespace, workdir: Path, synchronous: str = "FULL"
) -> Result:
    name = "sqlite" if synchronous == "FULL" else f"sqlite-{synchronous.lower()}"
    runtime = SqliteRuntime(workdir / f"{name}.db", synchronous=synchronous)
    floor = SqliteFloor(workdir / f"{name}-floor.db", synchronous)
    try:
        await floor.open()
        await runtime.migrate()
        return await measure(name, runtime, args, floor)
    finally:
        await runtime.close()
        await floor.close()


def _scratch_dsn(admin_dsn: str, database: str) -> str:
    parts = urllib.parse.urlsplit(admin_dsn)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{database}"))


async def bench_postgres(args: argparse.Namespace) -> Result:
    import asyncpg

    name = f"loom_bench_{str(ULID()).lower()}"
    try:
        admin = await asyncpg.connect(args.pg_dsn, timeout=5)
    except (OSError, asyncpg.PostgresError) as exc:
        return Result("postgres", note=f"skipped: cannot connect to {args.pg_dsn}: {exc}")
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = _scratch_dsn(args.pg_dsn, name)
        runtime = await PostgresRuntime.connect(dsn)
        floor = PostgresFloor(runtime.pool, dsn)
        try:
            await floor.open()
            return await measure("postgres", runtime, args, floor)
        finally:
            await floor.close()
            await runtime.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


# -- telemetry on by default ---------------------------------------------------------------


@dataclass
class TelemetryCost:
    """Per-step seconds, default telemetry (no SDK) vs telemetry=False, medians of batches."""

    fresh_on: list[float] = field(default_factory=list)
    fresh_off: list[float] = field(default_factory=list)
    hit_on: list[float] = field(default_factory=list)
    hit_off: list[float] = field(default_factory=list)
    agent_on: list[float] = field(default_factory=list)
    agent_off: list[float] = field(default_factory=list)
    # The default telemetry without the OTel instruments (Prometheus and spans only).
    fresh_prom: list[float] = field(default_factory=list)
    hit_prom: list[float] = field(default_factory=list)
    agent_prom: list[float] = field(default_factory=list)
    # Metrics.observe_step alone (what every step's metrics cost), with and without OTel.
    observe_otel: list[float] = field(default_factory=list)
    observe_prom: list[float] = field(default_factory=list)


async def bench_telemetry(args: argparse.Namespace) -> TelemetryCost:
    from loomflow.agent import Agent
    from loomflow.messages import ToolCall
    from loomflow.models import ScriptedModel
    from loomflow.telemetry import Metrics, Telemetry, default_telemetry
    from loomflow.tools import tool

    @tool
    def lookup(order: int) -> str:
        """Look an order up."""
        return "shipped"

    payload = make_payload(args.payload)
    cost = TelemetryCost()
    on, off, prom = InMemoryRuntime(), InMemoryRuntime(), InMemoryRuntime()
    default_telemetry().instrument(on)  # what an agent without telemetry= does on its first run
    prom_only = Telemetry(metrics=Metrics(otel=False))
    prom_only.instrument(prom)
    turns: list[Any] = [[ToolCall(id="c1", name="lookup", arguments={"order": 7})], "Shipped."]
    agent_on = Agent("x", model=ScriptedModel(turns), tools=[lookup], runtime=InMemoryRuntime())
    agent_off = agent_on.clone(runtime=InMemoryRuntime(), telemetry=False)
    agent_prom = agent_on.clone(runtime=InMemoryRuntime(), telemetry=prom_only)
    runs = max(args.steps // 8, 5)
    for batch in range(args.batches + 1):  # the first batch warms up and is dropped
        for runtime, fresh, hits in (
            (on, cost.fresh_on, cost.hit_on),
            (off, cost.fresh_off, cost.hit_off),
            (prom, cost.fresh_prom, cost.hit_prom),
        ):
            session = f"tel-{batch}"
            # The steps' own times: the batch as a whole also holds its session's open and a
            # gc.collect(), which would be charged to the steps.
            steps, _ = await fresh_batch(runtime, session, args.steps, lambda: payload, {})
            fresh_s = statistics.median(steps)
            hit_s = await hit_batch(runtime, session, args.steps)
            if batch:
                fresh.append(fresh_s)
                hits.append(hit_s)
        for agent, per_step in (
            (agent_on, cost.agent_on),
            (agent_off, cost.agent_off),
            (agent_prom, cost.agent_prom),
        ):
            gc.collect()
            t0 = time.perf_counter()
            for i in range(runs):
                result = await agent.run("where?", session_id=f"a-{batch}-{i}", user_id=USER)
                assert result.output == "Shipped."
            # A run journals 4 steps: model call, tool call, model call, memory episode.
            if batch:
                per_step.append((time.perf_counter() - t0) / (runs * 4))
    observe_step_cost(cost, args)
    return cost


def observe_step_cost(cost: TelemetryCost, args: argparse.Namespace) -> None:
    """Time ``Metrics.observe_step`` with the no-op OTel instruments and without them."""
    from loomflow.runtime import StepEvent
    from loomflow.telemetry import Metrics

    event = StepEvent(
        backend="memory", session_id="s", user_id="u", epoch=0, path=(), name="model_call_0",
        kind="model", stream=True, outcome="miss", duration_s=0.001, write_s=0.0001,
    )  # fmt: skip
    calls = args.steps * 50
    for batch in range(args.batches + 1):
        for metrics, per_step in (
            (Metrics(), cost.observe_otel),
            (Metrics(otel=False), cost.observe_prom),
        ):
            observe = metrics.observe_step
            t0 = time.perf_counter()
            for _ in range(calls):
                observe(event)
            if batch:
                per_step.append((time.perf_counter() - t0) / calls)


def report_telemetry(cost: TelemetryCost) -> None:
    print(
        "\ntelemetry on by default (no OpenTelemetry SDK installed: spans and OTel metrics are "
        "the API's no-ops), memory backend, us per step, median of batches; 'OTel metrics' is "
        "the default minus the same telemetry with Metrics(otel=False)"
    )
    header = (
        f"{'path':<28} {'default':>9} {'telemetry=False':>16} {'added':>8} {'OTel metrics':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, with_, without, prom in (
        ("runtime.step (fresh)", cost.fresh_on, cost.fresh_off, cost.fresh_prom),
        ("runtime.step (hit)", cost.hit_on, cost.hit_off, cost.hit_prom),
        ("agent run, per step", cost.agent_on, cost.agent_off, cost.agent_prom),
    ):
        a, b, c = statistics.median(with_), statistics.median(without), statistics.median(prom)
        print(f"{name:<28} {_us(a):>9} {_us(b):>16} {_us(a - b):>8} {_us(a - c):>13}")
    on, off = statistics.median(cost.observe_otel), statistics.median(cost.observe_prom)
    print(
        f"Metrics.observe_step alone: {_us(on)} us with the no-op OTel instruments, "
        f"{_us(off)} us without: {_us(on - off)} us per step"
    )


# -- report ----------------------------------------------------------------------------------


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report(results: list[Result], args: argparse.Namespace) -> bool:
    print(
        f"\nloomflow runtime.step() overhead: {args.steps} steps x {args.batches} batches, "
        f"{args.payload}-byte result. fresh, floors: median us per call (each step call is "
        "paired with one insert of every floor variant); hit: median over batches of the "
        "mean us per replayed step.\n"
    )
    header = (
        f"{'backend':<13} {'fresh us':>10} {'insert floor us':>16} {'fresh/floor':>12} "
        f"{'target':>16} {'hit us':>8} {'(<=25)':>7} {'read floor us':>14}"
    )
    print(header)
    print("-" * len(header))
    all_ok = True
    for r in results:
        if r.note:
            print(f"{r.backend:<13} {r.note}")
            continue
        fresh = statistics.median(r.fresh)
        hit = statistics.median(r.hit)
        hit_ok = hit * 1e6 <= HIT_TARGET_US
        floor = r.floor()
        if floor is None:
            floor_s = ratio_s = verdict = "-"
        else:
            ratio = fresh / floor[1]
            ratio_ok = ratio <= FRESH_TARGETS[r.backend]
            all_ok &= ratio_ok
            floor_s, ratio_s, verdict = _us(floor[1]), f"{ratio:.3f}x", _verdict(ratio_ok)
        all_ok &= hit_ok
        read = _us(statistics.median(r.read_floor)) if r.read_floor else "-"
        if floor is not None:
            verdict = f"<={FRESH_TARGETS[r.backend]}x {verdict}"
        print(
            f"{r.backend:<13} {_us(fresh):>10} {floor_s:>16} {ratio_s:>12} {verdict:>16} "
            f"{hit * 1e6:>8.1f} {_verdict(hit_ok):>7} {read:>14}"
        )

    print("\nper-call distribution (us): the cheaper insert variant is the floor")
    header = f"  {'backend':<9} {'call':<30} {'p50':>9} {'mean':>9} {'p90':>9} {'p99':>9}"
    print(header)
    for r in results:
        rows = [("runtime.step (fresh)", r.fresh)] if r.fresh else []
        rows += [(f"INSERT {name}", values) for name, values in r.floors.items()]
        rows += [("SELECT by primary key", r.read_floor)] if r.read_floor else []
        for name, values in rows:
            print(
                f"  {r.backend:<9} {name:<30} {_us(statistics.median(values)):>9} "
                f"{_us(statistics.fmean(values)):>9} {_us(_p(values, 0.9)):>9} "
                f"{_us(_p(values, 0.99)):>9}"
            )

    print(
        f"\nresume of a {args.resume_steps:,}-step run: open = lease claim + the single load "
        f"query; median of {args.resume_reps} (target <= {RESUME_TARGET_MS:g} ms)"
    )
    header = f"{'backend':<9} {'open ms':>9} {'hits ms':>9} {'total ms':>9} {'':>7}"
    print(header)
    print("-" * len(header))
    for r in results:
        if r.note or not r.resume:
            continue
        mid = sorted(r.resume, key=lambda x: x.total_ms)[len(r.resume) // 2]
        ok = mid.total_ms <= RESUME_TARGET_MS
        all_ok &= ok
        print(
            f"{r.backend:<9} {mid.open_ms:>9.2f} {mid.hits_ms:>9.2f} {mid.total_ms:>9.2f} "
            f"{_verdict(ok):>7}"
        )
    print(f"\nall targets met: {'yes' if all_ok else 'NO'}")
    return all_ok


async def profile_hits(args: argparse.Namespace, workdir: Path) -> None:
    """cProfile the replay path (open + 1,000 hits) on SQLite: where the hit time goes."""
    runtime = SqliteRuntime(workdir / "profile.db")
    payload = make_payload(args.payload)
    try:
        await build_run(runtime, "profile", args.resume_steps, lambda: payload)
        await resume_once(runtime, "profile", args.resume_steps)
        gc.collect()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            await resume_once(runtime, "profile", args.resume_steps)
        profiler.disable()
    finally:
        await runtime.close()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    print(f"\ncProfile of 5 resumes of {args.resume_steps:,} steps (SQLite), by own time:")
    print(out.getvalue())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Per-step cost of loomflow's journal against the raw database floor."
    )
    p.add_argument("--steps", type=int, default=200, help="steps per batch (default 200)")
    p.add_argument("--batches", type=int, default=7, help="timed batches (default 7)")
    p.add_argument("--payload", type=int, default=200, help="encoded result bytes (200)")
    p.add_argument("--resume-steps", type=int, default=1000, help="size of the resumed run")
    p.add_argument("--resume-reps", type=int, default=7, help="timed resumes (default 7)")
    p.add_argument(
        "--pg-dsn",
        default=PG_DSN,
        help="server to create the scratch database on",
    )
    p.add_argument("--skip-postgres", action="store_true")
    p.add_argument("--skip-sqlite", action="store_true")
    p.add_argument("--profile", action="store_true", help="also cProfile the replay path")
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> int:
    results = [await bench_memory(args)]
    with tempfile.TemporaryDirectory(prefix="loomflow-bench-") as tmp:
        workdir = Path(tmp)
        if not args.skip_sqlite:
            results.append(await bench_sqlite(args, workdir))
            results.append(await bench_sqlite(args, workdir, "NORMAL"))
        if not args.skip_postgres:
            results.append(await bench_postgres(args))
        ok = report(results, args)
        report_telemetry(await bench_telemetry(args))
        if args.profile:
            await profile_hits(args, workdir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
