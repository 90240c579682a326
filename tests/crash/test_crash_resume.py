"""SIGKILL a worker in the middle of a run; a second process resumes it.

Steps journaled before the kill must not run again; the rest run exactly once. The takeover
must be immediate: the dead worker ran on this host, so its lease (30 s here) is not waited
out, and the resumer's ``turn_timeout`` (10 s) is shorter than that lease, so a lease wait
would fail the test instead of merely slowing it down.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from _harness import Child, Journal, bodies_by_step, kill_all, read_log

pytestmark = [pytest.mark.crash, pytest.mark.timeout(120)]

N = 6
SESSION, USER = "session-1", "user-1"
LEASE_S = 30.0
TURN_TIMEOUT_S = 10.0
# Opening the run after the kill includes the takeover; far below the 30 s lease.
TAKEOVER_BUDGET_S = 2.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Journal:
    if request.param == "sqlite":
        return Journal("sqlite", str(tmp_path / "journal.db"))
    return Journal("postgres", request.getfixturevalue("pg_dsn"))


def _worker_args(journal: Journal, log: Path, *extra: str) -> list[str]:
    return [
        *journal.worker_args(),
        "--log", str(log),
        "--session", SESSION,
        "--user", USER,
        "--steps", str(N),
        "--lease", str(LEASE_S),
        "--turn-timeout", str(TURN_TIMEOUT_S),
        *extra,
    ]  # fmt: skip


async def _kill_then_resume(
    journal: Journal, tmp_path: Path, pause: str, k: int
) -> tuple[Child, Child, list[dict[str, object]], float]:
    """Run a worker until it reports ``pause`` at step k, SIGKILL it, resume in a new process."""
    log = tmp_path / "effects.log"
    first = await Child.spawn("first", _worker_args(journal, log, pause, str(k)), workdir=tmp_path)
    children = [first]
    try:
        await first.expect("inside" if pause == "--pause-inside" else "paused")
        first.signal(signal.SIGKILL)
        assert await first.exit_code() == -signal.SIGKILL  # reaped: the pid is really gone

        started = time.monotonic()
        second = await Child.spawn("second", _worker_args(journal, log), workdir=tmp_path)
        children.append(second)
        assert await second.exit_code() == 0, second.diagnose("failed to resume")
        resume_s = time.monotonic() - started
        return first, second, read_log(log), resume_s
    finally:
        await kill_all(children)


@pytest.mark.parametrize("k", [1, N - 1])
async def test_killed_between_steps_resumes_without_rerunning(
    journal: Journal, tmp_path: Path, k: int
) -> None:
    first, second, log, resume_s = await _kill_then_resume(journal, tmp_path, "--pause-after", k)

    # Every body ran exactly once over both processes ...
    assert bodies_by_step(log) == {i: 1 for i in range(1, N + 1)}
    # ... 1..k in the killed worker, k+1..N in the resumer.
    ran_by = {m["step"]: m["pid"] for m in log if m["what"] == "begin"}
    assert {i for i, pid in ran_by.items() if pid == first.pid} == set(range(1, k + 1))
    assert {i for i, pid in ran_by.items() if pid == second.pid} == set(range(k + 1, N + 1))

    done = second.last("done")
    assert done["epoch"] == 0  # the same run, continued, not a new one
    assert done["hits"] == [f"step-{i}" for i in range(1, k + 1)]
    assert done["fresh"] == [f"step-{i}" for i in range(k + 1, N + 1)]
    assert done["claim_s"] < TAKEOVER_BUDGET_S, "dead local owner was not taken over at once"
    assert resume_s < TURN_TIMEOUT_S

    runtime = await journal.open()
    try:
        entries = await runtime.entries(SESSION, USER)
    finally:
        await runtime.close()
    assert sorted((e.epoch, e.name) for e in entries) == sorted(
        (0, f"step-{i}") for i in range(1, N + 1)
    )


async def test_killed_inside_a_step_reruns_only_that_step(journal: Journal, tmp_path: Path) -> None:
    # The body of step k+1 had its side effect but its result was never journaled: the
    # journal promises at-least-once, so exactly that body runs a second time.
    k = 2
    _, second, log, _ = await _kill_then_resume(journal, tmp_path, "--pause-inside", k + 1)

    expected = {i: 1 for i in range(1, N + 1)}
    expected[k + 1] = 2
    assert bodies_by_step(log) == expected
    done = second.last("done")
    assert done["hits"] == [f"step-{i}" for i in range(1, k + 1)]
    assert done["fresh"] == [f"step-{i}" for i in range(k + 1, N + 1)]
    assert done["claim_s"] < TAKEOVER_BUDGET_S
