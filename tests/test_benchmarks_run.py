"""The benchmarks still run and print their verdicts (tiny sizes: this checks shape, not speed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


@pytest.mark.postgres
def test_agent_overhead_prints_a_verdict_per_target(pg_dsn: str) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "agent_overhead.py"), "--turns", "2", "--runs", "1",
         "--rounds", "2", "--pg-dsn", pg_dsn],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    verdicts = re.findall(r"^  (sqlite|postgres): journaled turn .*: (ok|MISSED)$", out, re.M)
    assert [backend for backend, _ in verdicts] == ["sqlite", "postgres"], out
    row = re.search(r"^sqlite +[\d,]+ +[\d,]+ +[\d.]+x +([\d.]+) +[\d,]+$", out, re.M)
    assert row, out
    # Each of the 3 turns journals a model call, all but the last a tool call too, and the run
    # claims, records an episode and closes: at least 2 commits a turn are traced.
    assert float(row.group(1)) >= 2.0, out


@pytest.mark.postgres
def test_memory_recall_prints_a_verdict_per_backend(pg_dsn: str) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "memory_recall.py"), "--episodes", "300",
         "--rounds", "1", "--repeat", "2", "--pg-dsn", pg_dsn],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    verdicts = re.findall(r"^(sqlite|postgres) +recall of 20 episodes: .*: (ok|MISSED)$", out, re.M)
    assert [backend for backend, _ in verdicts] == ["sqlite", "postgres"], out
    assert out.rstrip().splitlines()[-1].startswith("all targets met: "), out
