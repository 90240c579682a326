"""The run-hook contract, kept importable here: it lives in :mod:`loomflow.hooks`.

Governance, audit and telemetry implement these hooks without importing the agent; the agent
calls them. ``from loomflow.agent.hooks import RunHooks`` keeps working.
"""

from __future__ import annotations

from ..hooks import Interrupt, RunHooks, RunInfo

__all__ = ["Interrupt", "RunHooks", "RunInfo"]
