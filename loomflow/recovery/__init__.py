"""Recover runs that outlived their worker: find orphans, claim them, resume them.

A run whose process died (SIGKILL, OOM, a lost node) stays open in the journal with an owner
whose lease runs out. :class:`Recovery` finds such runs, claims each through the same lease
and fencing token the runs use (so two recoverers never run one run), and resumes it with the
inputs its agent stored when it began, through the agent registered under the name the run
recorded. ``loomflow worker APP`` runs one as a long-lived process.

Example:
    >>> async with Recovery(runtime, {"orders": orders_agent}) as recovery:  # doctest: +SKIP
    ...     report = await recovery.sweep()
    ...     await recovery.wait()
"""

from __future__ import annotations

from ._cancel import cancel_run
from ._recovery import Recoverable, Recovery, RunRef, SweepReport, default_backoff

__all__ = ["Recoverable", "Recovery", "RunRef", "SweepReport", "cancel_run", "default_backoff"]
