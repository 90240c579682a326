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


def test_ci_installs_the_tools_the_docs_blocks_pipe_into() -> None:
    # tests/test_docs_walkthrough.py runs docs/audit.md's shell block, which pipes into jq, and
    # fails in CI without it: a clean CI machine must install it before the tests run.
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"apt-get install [^\n]* jq\b", ci)
    assert install is not None
    assert "command -v jq" in ci
    assert install.start() < ci.index(".venv/bin/pytest")  # before the tests run


def test_ci_refuses_an_empty_test_run() -> None:
    assert '"$rc" -eq 5' in (ROOT / ".ci" / "run").read_text()


def test_public_names_are_exported_and_sorted() -> None:
    for module in (loomflow, loomflow.runtime, loomflow.errors):
        names = list(module.__all__)
        assert names == sorted(names), module.__name__
        for name in names:
            assert getattr(module, name) is not None


def test_version_follows_0_20_and_is_written_once() -> None:
    import importlib.metadata
    import tomllib

    from packaging.version import Version

    # pip only upgrades a 0.20 install to a release that sorts above it.
    assert Version(loomflow.__version__) > Version("0.20.999")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["hatch"]["version"]["path"] == "loomflow/__init__.py"
    init = (ROOT / "loomflow" / "__init__.py").read_text()
    assert len(re.findall(r"^__version__ = ", init, flags=re.M)) == 1
    # What the installed metadata (and so pip) reports is the same string.
    assert importlib.metadata.version("loomflow") == loomflow.__version__
