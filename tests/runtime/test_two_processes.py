"""Two real processes on one journal (a PostgreSQL database or one SQLite file).

Turn-taking: runs on one (session, user) never interleave across processes. Fencing: a worker
frozen past its lease loses the turn: it runs no further step body, its write of a body that
was already running is refused by the store, and the new owner's entries stand.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from _process_harness import harness as h  # the crash tests' process helpers

from loomflow.runtime import JournalRuntime

pytestmark = pytest.mark.timeout(120)

SESSION, USER = "shared-session", "shared-user"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        return h.Journal("sqlite", str(tmp_path / "journal.db"))
    return h.Journal("postgres", request.getfixturevalue("pg_dsn"))


def _args(journal: Any, log: Path, *extra: str) -> list[str]:
    return [*journal.worker_args(), "--log", str(log), "--session", SESSION, "--user", USER, *extra]


async def _entries(journal: Any) -> list[tuple[int, str]]:
    runtime: JournalRuntime = await journal.open()
    try:
        return [(e.epoch, e.name) for e in await runtime.entries(SESSION, USER)]
    finally:
        await runtime.close()


async def test_runs_on_one_session_take_turns(journal: Any, tmp_path: Path) -> None:
    steps = 4
    log = tmp_path / "markers.log"
    # 4 steps x 2 gaps of 30 ms: each run holds the turn for >= 240 ms, far longer than it
    # takes both workers to ask for it after the shared "go".
    args = _args(journal, log, "--steps", str(steps), "--gap", "0.03", "--wait-go")
    children = [await h.Child.spawn(f"p{i}", args, workdir=tmp_path) for i in (1, 2)]
    try:
        for child in children:
            await child.expect("ready")  # both connected and migrated
        for child in children:
            await child.send("go")
        for child in children:
            assert await child.exit_code() == 0, child.diagnose("did not finish")
    finally:
        await h.kill_all(children)

    markers = h.read_log(log)
    wants = [m for m in markers if m["what"] == "want"]
    run_markers = [m for m in markers if m["what"] != "want"]
    first_pid = run_markers[0]["pid"]
    first_close = next(
        i for i, m in enumerate(markers) if m["what"] == "close" and m["pid"] == first_pid
    )
    # The premise: both processes asked for the turn while the first run held it.
    assert len(wants) == 2
    assert all(markers.index(w) < first_close for w in wants), markers
    # One run's open, steps and close all come before any of the other's.
    owners = [m["pid"] for m in run_markers]
    switch = owners.index(next(p for p in owners if p != first_pid))
    assert set(owners[:switch]) == {first_pid}
    assert first_pid not in owners[switch:], f"runs interleaved: {run_markers}"
    per_run = 2 + 2 * steps  # open, begin/end per step, close
    assert switch == per_run
    assert len(owners) == 2 * per_run

    # The second run found the first one finished, so it opened the next epoch.
    epochs = sorted(child.last("done")["epoch"] for child in children)
    assert epochs == [0, 1]
    assert all(child.last("done")["hits"] == [] for child in children)
    assert sorted(await _entries(journal)) == sorted(
        (epoch, f"step-{i}") for epoch in (0, 1) for i in range(1, steps + 1)
    )


@pytest.mark.parametrize("frozen", ["between_steps", "inside_step"])
async def test_frozen_owner_is_fenced_out_after_its_lease(
    journal: Any, tmp_path: Path, frozen: str
) -> None:
    log = tmp_path / "markers.log"
    lease_s = 1.0
    # A pauses after step 1, or inside the body of step 2 (so its write of step 2 reaches the
    # store and must be refused by the fencing token in the INSERT itself).
    pause = ["--pause-after", "1"] if frozen == "between_steps" else ["--pause-inside", "2"]
    a_args = _args(journal, log, "--steps", "3", "--tag", "A", "--lease", str(lease_s), *pause)
    b_args = _args(journal, log, "--steps", "3", "--tag", "B", "--turn-timeout", "30")
    a = await h.Child.spawn("A", a_args, workdir=tmp_path)
    children = [a]
    try:
        paused = await a.expect("paused" if frozen == "between_steps" else "inside")
        await h.freeze(a, journal)

        b = await h.Child.spawn("B", b_args, workdir=tmp_path)
        children.append(b)
        assert await b.exit_code() == 0, b.diagnose("did not finish")

        a.signal(signal.SIGCONT)
        await a.send("go")
        assert await a.exit_code() == 3, a.diagnose("was not fenced out")
    finally:
        await h.kill_all(children)

    lost = a.last("lost")["error"]
    a_bodies = [m["step"] for m in h.read_log(log) if m["what"] == "begin" and m["pid"] == a.pid]
    if frozen == "inside_step":
        # A's body of step 2 was already running when it lost the turn: it finishes, and the
        # store refuses to journal its result. Nothing can take back a body in progress.
        assert "ran but was not journaled" in lost
        assert a_bodies == [1, 2]
    else:
        # Continued past its lease, A learns that B owns the turn before the next body: either
        # its heartbeat wakes first and is refused, or the step asks the store itself. Either
        # way it says so in one wording, and step 2 (which B already ran) does not run again.
        assert "was not started" in lost, lost
        assert a_bodies == [1]

    # B continued A's open run: step 1 replayed from A's entry, steps 2 and 3 its own.
    done = b.last("done")
    assert done["epoch"] == 0
    assert done["hits"] == ["step-1"]
    assert done["fresh"] == ["step-2", "step-3"]
    # A was alive (frozen), so B had to wait for the lease to run out. A renews every
    # lease/3, so its lease ended at least 2/3 of a lease after it paused.
    b_open = next(m for m in h.read_log(log) if m["what"] == "open" and m["pid"] == b.pid)
    assert b_open["t"] - paused["t"] >= lease_s / 2

    # A's step 2 is not in the journal: exactly A's step 1 and B's steps 2 and 3 are.
    assert sorted(await _entries(journal)) == [(0, "step-1"), (0, "step-2"), (0, "step-3")]
    runtime: JournalRuntime = await journal.open()
    try:

        def must_replay(i: int) -> Any:
            raise AssertionError(f"step-{i} was not journaled")

        async with runtime.session(SESSION, USER, resume=True) as run:
            values = [await runtime.step(f"step-{i}", must_replay, i) for i in (1, 2, 3)]
        assert run.epoch == 0
    finally:
        await runtime.close()
    assert [(v["step"], v["by"]) for v in values] == [(1, "A"), (2, "B"), (3, "B")]
    assert values[0]["pid"] == a.pid
    assert values[1]["pid"] == b.pid
