"""A new user's first minutes with the command line, each case a real process."""

from __future__ import annotations

import subprocess
import sys

from _cli import clean_env

# Ctrl-C lands while the command groups' modules are imported to build the parser (they are
# loaded on first use, so this is the second or so after the prompt returns on a cold disk).
_CTRL_C_WHILE_THE_PARSER_IS_BUILT = """
import importlib, os, signal, sys
from loomflow.cli import main  # the entry point, taken before its submodule shadows it

cli_main = importlib.import_module("loomflow.cli.main")

load = cli_main._command_modules

def interrupted_load():
    os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode, inside the load
    return load()

cli_main._command_modules = interrupted_load
sys.argv = ["loomflow", "demo"]
main()
"""


def test_ctrl_c_while_the_parser_is_built_exits_130_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_THE_PARSER_IS_BUILT],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr
    assert done.stdout == ""  # the demo never started
