"""loomflow: durable, governed and observable LLM agent runs."""

from __future__ import annotations

from .context import RunContext, get_run_context
from .errors import LoomflowError

__all__ = ["LoomflowError", "RunContext", "get_run_context"]
__version__ = "0.1.0"
