"""Project-level promises: the README's commands, CI, and the public surface."""

from __future__ import annotations

import re
from pathlib import Path

import loomflow
import loomflow.errors
import loomflow.runtime

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_gives_the_main_job_and_the_test_command() -> None:
    blocks = _bash_blocks()
    assert blocks[0].endswith("loomflow demo")
    assert blocks[1].endswith("pytest")


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _bash_blocks()[1] in ci


def test_ci_refuses_an_empty_test_run() -> None:
    assert '"$rc" -eq 5' in (ROOT / ".ci" / "run").read_text()


def test_public_names_are_exported_and_sorted() -> None:
    for module in (loomflow, loomflow.runtime, loomflow.errors):
        names = list(module.__all__)
        assert names == sorted(names), module.__name__
        for name in names:
            assert getattr(module, name) is not None
