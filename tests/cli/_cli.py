"""Running the command line as a user does: a new interpreter, the settings of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the caller's LOOMFLOW_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    return {**env, **extra}


def loomflow(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``loomflow ARGS`` in a new process; ``env`` replaces the environment (by default the
    caller's without its LOOMFLOW_* settings)."""
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
        env=env if env is not None else clean_env(),
    )
