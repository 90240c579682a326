"""The text that stands in for a sealed tool argument (see ``loomflow.agent._sealing``).

Kept apart so that the permission layer can tell a call whose sealed values this process no
longer holds (a run resumed elsewhere) without importing the agent loop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["SEALED_ARGUMENT", "holds_sealed_argument"]

SEALED_ARGUMENT = re.compile(r"^\[sealed:[0-9a-f]{20}\]$")
"""A sealed argument's placeholder: ``[sealed:<20 hex digits of an HMAC>]``."""


def holds_sealed_argument(arguments: Mapping[str, Any]) -> bool:
    """Whether any top-level argument is a sealed placeholder."""
    return any(isinstance(v, str) and SEALED_ARGUMENT.match(v) for v in arguments.values())
