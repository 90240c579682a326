"""Sealing, kept importable here for the 0.21 path: it lives in the agent package.

The agent loop seals sensitive tool arguments and results before they are journaled (see
``loomflow.agent._sealing``); the audit log itself never seals anything. Nothing inside
loomflow imports this module, which is the one place below the agent that names it.
"""

from __future__ import annotations

from ..agent._sealing import SEALED_ERROR, SEALED_RESULT_LOST, SealedValueLost, Sealer

__all__ = ["SEALED_ERROR", "SEALED_RESULT_LOST", "SealedValueLost", "Sealer"]
