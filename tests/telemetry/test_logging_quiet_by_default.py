"""loomflow's logger stays silent in an application that configured no logging."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, sys
import loomflow
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING)
logging.getLogger("loomflow.runtime").warning("journal write failed, retrying in 0.1 s")
print("done")
"""


def run(mode: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        env={k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_warning_prints_nothing_when_the_app_set_up_no_logging(tmp_path: Path) -> None:
    done = run("bare", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"
    assert done.stderr == ""


def test_a_warning_still_reaches_a_handler_the_app_configured(tmp_path: Path) -> None:
    done = run("configured", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "WARNING:loomflow.runtime:journal write failed, retrying in 0.1 s" in done.stderr


def test_the_package_logger_has_a_null_handler() -> None:
    import loomflow  # noqa: F401

    handlers = logging.getLogger("loomflow").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)
