"""Redaction, kept importable here: it lives in :mod:`loomflow.redaction`.

Everything that stores or exports text (the audit log, telemetry, the agent's journal) scrubs
it with the same :class:`~loomflow.redaction.Redactor`, so redaction sits below all of them.
"""

from __future__ import annotations

from ..redaction import (
    DEFAULT_SENSITIVE_KEYS,
    PII_KINDS,
    PLACEHOLDER,
    SCRUBBED_LOGGERS,
    SECRET_PATTERNS,
    Redactor,
    install_log_redaction,
)

__all__ = [
    "DEFAULT_SENSITIVE_KEYS",
    "PII_KINDS",
    "PLACEHOLDER",
    "SCRUBBED_LOGGERS",
    "SECRET_PATTERNS",
    "Redactor",
    "install_log_redaction",
]
