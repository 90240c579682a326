"""Progress bars for the long commands (journal prune, audit export and verify).

A bar is for a person watching a terminal: it goes to stderr, and only when stderr is a
terminal, so stdout (``--json``, exported lines) and anything piped or captured stay clean.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from .._progress import OnProgress

__all__ = ["add_no_progress", "progress_bar"]


def add_no_progress(parser: argparse.ArgumentParser) -> None:
    """Add the ``--no-progress`` flag to a command that draws a bar."""
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="draw no progress bar (one is drawn on stderr only when it is a terminal)",
    )


@contextlib.contextmanager
def progress_bar(description: str, *, unit: str, enabled: bool) -> Iterator[OnProgress | None]:
    """Yield an ``on_progress`` callback that draws a tqdm bar on stderr, or ``None``.

    ``None`` when ``enabled`` is false or stderr is no terminal: nobody would see the bar, and
    without a callback the library also skips the count it makes to give the bar a total.
    """
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm  # only commands that draw a bar pay for the import

    try:
        width = os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        width = 0
    # A terminal that reports no size (0x0: a fresh `docker exec -t`, a bare pty) would hide
    # the bar: tqdm then sees no free row to draw on. Assume 80x24 there.
    sizing: dict[str, Any] = {"dynamic_ncols": True} if width else {"ncols": 80, "nrows": 24}
    with tqdm(desc=description, unit=unit, file=sys.stderr, **sizing) as bar:

        def on_progress(done: int, total: int | None) -> None:
            if total != bar.total:
                bar.total = total
                bar.refresh()  # show the new total now, not at the next throttled update
            bar.update(done - bar.n)

        yield on_progress
