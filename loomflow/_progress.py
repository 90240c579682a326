"""Progress reports of long maintenance work (journal prune, audit export and verify).

Library code only calls a plain ``on_progress(done, total)`` callback; drawing a bar is the
CLI's business (``loomflow.cli._progress``, with tqdm), so library calls never touch a
terminal.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["OnProgress", "Progress"]

OnProgress = Callable[[int, int | None], None]
"""``on_progress(done, total)``: items done so far, and the total if known (``None`` if not)."""


class Progress:
    """Feeds an optional :data:`OnProgress` callback; does nothing without one.

    The first report is ``(0, total)``. ``done`` only grows, and ``total`` never falls behind
    it: rows written while the work runs can add to what was counted up front. The last report
    is always ``(n, n)`` with ``n`` the final count, so a bar ends full.

    Args:
        callback: Where to report, or ``None``.
        total: What was counted before the work started.
        every: Report at most once per this many items (the last report always goes out).
    """

    def __init__(self, callback: OnProgress | None, total: int | None, *, every: int = 1) -> None:
        self.callback = callback
        self.total = total
        self.done = 0
        self._every = every
        self._reported = 0
        if callback is not None:
            callback(0, total)

    def advance(self, n: int) -> None:
        """Count ``n`` more items done."""
        self.done += n
        if self.callback is None or self.done - self._reported < self._every:
            return
        if self.total is not None and self.done > self.total:
            self.total = self.done
        self._reported = self.done
        self.callback(self.done, self.total)

    def finish(self) -> None:
        """Send the closing ``(n, n)`` report, unless the last report already said so."""
        if self.callback is None:
            return
        if (self._reported, self.total) != (self.done, self.done):
            self.total = self._reported = self.done
            self.callback(self.done, self.done)
