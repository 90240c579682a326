"""The ``loomflow`` command line."""

from __future__ import annotations


def main() -> None:
    try:
        from .main import main as run
    except KeyboardInterrupt:
        # Ctrl-C while the command's modules load (a second or so on a cold disk): the same
        # quiet exit as an interrupted command, not a traceback through the import system.
        raise SystemExit(130) from None

    raise SystemExit(run())
