"""The ``loomflow`` command line."""

from __future__ import annotations


def main() -> None:
    from .main import main as run

    raise SystemExit(run())
