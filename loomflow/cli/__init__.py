"""The ``loomflow`` command line."""

from __future__ import annotations

import signal


def main() -> None:
    try:
        from .main import main as run

        code = run()
    except KeyboardInterrupt:
        # Ctrl-C while the command's modules load (a second or so on a cold disk), here or
        # while the parser imports the command groups: the same quiet exit as an interrupted
        # command, not a traceback through the import system.
        raise SystemExit(130) from None
    # The command is done and its exit code decided. A Ctrl-C from here on would land while
    # the interpreter shuts down, after Python's own handler is gone, and kill the process by
    # signal instead of exiting with that code.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(code)
