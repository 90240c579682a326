"""The loomflow exception tree.

Every error loomflow raises derives from :class:`LoomflowError`::

    LoomflowError
    ├── UserError                      misuse of the API (fix the calling code)
    │   └── NoActiveRunError           runtime.step() outside runtime.session()
    ├── ConfigurationError             bad settings or an unusable store URL
    ├── JournalError                   the journal could not do what was asked
    │   ├── JournalEncodeError         a value has no journal encoding
    │   ├── PayloadTooLargeError       a step result exceeds the size cap
    │   ├── CorruptEntryError          a stored entry cannot be decoded (strict mode)
    │   ├── ReplayDivergenceError      a replayed position got other inputs (strict mode)
    │   ├── SessionBusyError           another run held the (session, user) too long
    │   ├── OwnershipLostError         this run was fenced out by a newer owner
    │   └── StoreUnavailableError      the database driver failed underneath us
    ├── MigrationError                 the schema could not be brought up to date
    └── ModelError                     a model provider call failed (provider, model, status)
        ├── ModelRetryExhaustedError   transient failures outlasted the retry budget
        └── ScriptExhaustedError       a scripted model was called more often than scripted

Driver exceptions (``sqlite3``/``aiosqlite``, ``asyncpg``) are mapped to
:class:`StoreUnavailableError` in one place, ``loomflow.runtime._sql.translate_errors``,
and always chained with ``from``. Provider SDK exceptions (``anthropic``, ``openai``) are mapped
to :class:`ModelError` by one classifier per adapter in ``loomflow.models``, also with ``from``.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "CorruptEntryError",
    "JournalEncodeError",
    "JournalError",
    "LoomflowError",
    "MigrationError",
    "ModelError",
    "ModelRetryExhaustedError",
    "NoActiveRunError",
    "OwnershipLostError",
    "PayloadTooLargeError",
    "ReplayDivergenceError",
    "ScriptExhaustedError",
    "SessionBusyError",
    "StoreUnavailableError",
    "UserError",
]


class LoomflowError(Exception):
    """Base class of every error raised by loomflow."""


class UserError(LoomflowError):
    """The API was used in a way it does not support."""


class NoActiveRunError(UserError):
    """A journaled step was requested while no run is open on this runtime."""


class ConfigurationError(LoomflowError):
    """A setting or store URL is invalid."""


class MigrationError(LoomflowError):
    """A schema migration failed or the database is newer than this library."""


class JournalError(LoomflowError):
    """Base class of the journal's own failures."""


class JournalEncodeError(JournalError, TypeError):
    """A step's inputs or result contain a value the journal codec cannot encode."""

    def __init__(self, step: str, type_name: str, where: str) -> None:
        self.step = step
        self.type_name = type_name
        self.where = where
        super().__init__(
            f"step {step!r}: {where} holds a value of type {type_name!r} that the journal "
            "cannot encode; return JSON-like data, a pydantic model, a dataclass or one of "
            "the types listed in loomflow.runtime.codec"
        )


class PayloadTooLargeError(JournalError):
    """A step result is larger than the configured per-step cap."""

    def __init__(self, step: str, size: int, limit: int) -> None:
        self.step = step
        self.size = size
        self.limit = limit
        super().__init__(
            f"step {step!r}: encoded result is {size} bytes, over the {limit}-byte cap "
            "(raise max_payload_bytes or return less)"
        )


class CorruptEntryError(JournalError):
    """A journal entry exists but cannot be decoded."""


class ReplayDivergenceError(JournalError):
    """A replayed step position was reached with inputs other than the journaled ones."""

    def __init__(self, step: str, path: str, stored: str, current: str) -> None:
        self.step = step
        self.path = path
        self.stored_fingerprint = stored
        self.current_fingerprint = current
        super().__init__(
            f"step {step!r} (sub-run path {path}) diverged on replay: journaled inputs "
            f"{stored[:12]}…, now {current[:12]}…"
        )


class SessionBusyError(JournalError):
    """Another run kept the (session, user) turn for longer than the wait allows."""


class OwnershipLostError(JournalError):
    """A newer owner took the (session, user) turn; this run may no longer write."""


class StoreUnavailableError(JournalError):
    """The journal's database failed or could not be reached."""


class ModelError(LoomflowError):
    """A call to a model provider failed.

    Attributes:
        provider: The adapter's provider label, e.g. ``"anthropic"``.
        model: The model id the call used.
        status: The HTTP status of the failure, or ``None`` for connection-level failures.
        detail: The provider's own description of what went wrong.
    """

    def __init__(self, provider: str, model: str, detail: str, status: int | None = None) -> None:
        self.provider = provider
        self.model = model
        self.detail = detail
        self.status = status
        where = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"{provider} model {model!r} failed{where}: {detail}")

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-shaped __init__ arguments do not survive the default exception pickling.
        return (type(self), (self.provider, self.model, self.detail, self.status))


class ModelRetryExhaustedError(ModelError):
    """Every attempt at a model call hit a transient failure (429, 5xx, connection loss)."""

    def __init__(
        self, provider: str, model: str, detail: str, status: int | None = None, attempts: int = 1
    ) -> None:
        super().__init__(provider, model, detail, status)
        self.attempts = attempts
        where = f"HTTP {status}" if status is not None else "connection failure"
        self.args = (
            f"{provider} model {model!r} failed after {attempts} attempts; last error "
            f"({where}): {detail}",
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.provider, self.model, self.detail, self.status, self.attempts))


class ScriptExhaustedError(ModelError):
    """A scripted test model was asked for more turns than its script holds."""
