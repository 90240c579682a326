"""The loomflow exception tree.

Every error loomflow raises derives from :class:`LoomflowError`::

    LoomflowError
    ├── UserError                      misuse of the API (fix the calling code)
    │   ├── NoActiveRunError           runtime.step() outside runtime.session()
    │   ├── DuplicateStepError         one run reached a step name a second time
    │   ├── SessionExistsError         a fork's new session already has runs of the user
    │   ├── InvalidArgumentError       an argument's value is not accepted (also ValueError)
    │   │   └── InvalidIdError         an id is empty, too long or holds a control character
    │   ├── InvalidArgumentTypeError   an argument's type is not accepted (also TypeError)
    │   ├── ApprovalError              a deferred approval cannot be decided as asked
    │   │   ├── ApprovalNotFoundError  no pending request with that id in the session's last run
    │   │   ├── ApprovalDecidedError   the request was decided already
    │   │   └── ApprovalArgumentsError edited arguments do not fit the tool's schema
    │   ├── ReservedActionError        an audit action or chain loomflow keeps for its own entries
    │   └── UnknownUserError           no store holds anything about the user named
    ├── ConfigurationError             bad settings or an unusable store URL (also ValueError)
    ├── StorageError                   a store's database failed or is at the wrong version
    │   ├── StoreUnavailableError      the database driver failed underneath us
    │   │   └── StoreLockedError       another process kept the SQLite file's write lock
    │   └── MigrationError             the schema could not be brought up to date
    │       └── LegacyJournalError     a loomflow 0.20 journal is not laid out as expected
    ├── JournalError                   the journal could not do what was asked
    │   ├── JournalEncodeError         a value has no journal encoding (also TypeError)
    │   ├── PayloadTooLargeError       a step result exceeds the size cap
    │   ├── CorruptEntryError          a stored entry cannot be decoded (strict mode)
    │   │   ├── NewerEntryError        ... because a newer loomflow wrote it (always raised)
    │   │   └── MemoryEntryTooLargeError  ... because it is over a memory read's byte cap
    │   ├── ReplayDivergenceError      a replayed position got other inputs (strict mode)
    │   ├── SessionBusyError           a run holds the (session, user): too long, or in a forget
    │   └── OwnershipLostError         this run was fenced out by a newer owner
    │       └── RunCancelledError      ... because someone cancelled the run
    ├── AuditError                     the audit log could not do what was asked
    │   ├── AuditIntegrityError        the stored trail is damaged (run ``audit verify``)
    │   ├── ErasureRefusedError        the database role may not erase audit payloads
    │   ├── LegalHoldError             the user is under legal hold: nothing may be erased
    │   └── ProtectedChainError        a console chain (who looked at what) cannot be forgotten
    ├── CheckpointError                a checkpoint could not be found or read back
    │   └── CheckpointNotFoundError    no checkpoint with that id for this session and user
    ├── OutputValidationError          the final answer never fitted the run's output_type
    ├── SubAgentInterruptedError       an agent used as a tool stopped before it answered
    ├── BudgetError                    the budget would not vouch for a model call
    │   ├── BudgetExceededError        the call would cross a cap (agents end budget:<cap>)
    │   ├── BudgetUnavailableError     the budget store failed, so the call was refused
    │   ├── InvalidUsageError          a token count or cost is negative, NaN or absurd
    │   │   └── UntrustedUsageError    a model reported a token count that cannot be true
    │   └── UnknownModelPriceError     no price is known for the model being charged
    └── ModelError                     a model provider call failed (provider, model, status)
        ├── ModelRetryExhaustedError   transient failures outlasted the retry budget
        └── ScriptExhaustedError       a scripted model was called more often than scripted

Outside the tree on purpose: ``loomflow.runtime.codec``'s ``UnsupportedValueError`` (a
``TypeError``) and ``UnknownTagError`` (a ``ValueError``), which the journal wraps as
:class:`JournalEncodeError` and :class:`CorruptEntryError`; ``Interrupt``, a hook's control-flow
signal; and pydantic's ``ValidationError`` from the message and settings models.

Storage errors are their own branch because every store raises them (journal, checkpoints,
audit, budget and memory share one database): a failing database is not a journal error.
Before this release :class:`StoreUnavailableError` derived from :class:`JournalError`; code
that caught ``JournalError`` to cover database outages should catch :class:`StorageError`
too. The classes that also derive from ``ValueError`` or ``TypeError`` do so for callers that
caught the built-in error before loomflow raised its own.

Every class here survives ``pickle`` with its message and attributes: errors cross process
pools and are journaled. :class:`LoomflowError` restores the message and attributes without calling
``__init__`` again, so subclasses need no ``__reduce__`` of their own.

Driver exceptions (``sqlite3``/``aiosqlite``, ``asyncpg``) are mapped to
:class:`StoreUnavailableError` in one place, ``loomflow.storage._database.translate_errors``,
and always chained with ``from``. Provider SDK exceptions (``anthropic``, ``openai``) are mapped
to :class:`ModelError` by one classifier per adapter in ``loomflow.models``, also with ``from``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ApprovalArgumentsError",
    "ApprovalDecidedError",
    "ApprovalError",
    "ApprovalNotFoundError",
    "AuditError",
    "AuditIntegrityError",
    "BudgetError",
    "BudgetExceededError",
    "BudgetUnavailableError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "CorruptEntryError",
    "DuplicateStepError",
    "ErasureRefusedError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidIdError",
    "InvalidUsageError",
    "JournalEncodeError",
    "JournalError",
    "LegacyJournalError",
    "LegalHoldError",
    "LoomflowError",
    "MemoryEntryTooLargeError",
    "MigrationError",
    "ModelError",
    "ModelRetryExhaustedError",
    "NewerEntryError",
    "NoActiveRunError",
    "OutputValidationError",
    "OwnershipLostError",
    "PayloadTooLargeError",
    "ProtectedChainError",
    "ReplayDivergenceError",
    "ReservedActionError",
    "RunCancelledError",
    "ScriptExhaustedError",
    "SessionBusyError",
    "SessionExistsError",
    "StorageError",
    "StoreLockedError",
    "StoreUnavailableError",
    "SubAgentInterruptedError",
    "UnknownModelPriceError",
    "UnknownUserError",
    "UntrustedUsageError",
    "UserError",
]


def _rebuild(cls: type[BaseException], args: tuple[object, ...], state: dict[str, object]) -> Any:
    """Unpickle an error without calling its ``__init__`` (whose arguments are not ``args``)."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class LoomflowError(Exception):
    """Base class of every error raised by loomflow."""

    def __reduce__(self) -> tuple[object, ...]:
        # The default rebuilds with ``type(self)(*self.args)``, which breaks every subclass
        # whose ``__init__`` takes fields rather than the message: restore the state instead.
        return (_rebuild, (type(self), self.args, self.__dict__))


class UserError(LoomflowError):
    """The API was used in a way it does not support."""


class NoActiveRunError(UserError):
    """A journaled step was requested while no run is open on this runtime."""


class DuplicateStepError(UserError):
    """A run reached a step name it had already used (at the same sub-run path).

    The journal keys a step by its run position, its name: a second step of that name would
    replay the first one's result, or be told apart only by its arguments. Each step of a run
    needs its own name (``f"send_{n}"`` in a loop), or an ``idempotency_key``. A step that
    failed may be tried again under its name: only a completed or running step holds it.
    """

    def __init__(self, step: str, path: str) -> None:
        self.step = step
        self.path = path
        super().__init__(
            f"step {step!r} (sub-run path {path}) was already used in this run: give each "
            f"step of a run its own name (in a loop, {step + '_0'!r}, {step + '_1'!r}, ...) "
            "or an idempotency_key"
        )


class SessionExistsError(UserError):
    """A run that needs a session of its own (a fork's ``fork_session_id``) found runs of
    the user there already, maybe of another process forking into the same id."""


class InvalidArgumentError(UserError, ValueError):
    """An argument or option has a value the call does not accept (the message names it)."""


class InvalidArgumentTypeError(UserError, TypeError):
    """An argument has a type the call does not accept (the message names it)."""


class InvalidIdError(InvalidArgumentError):
    """An id (session, user, run, checkpoint, idempotency key) breaks the id rules.

    Attributes:
        field: The argument at fault, e.g. ``"user_id"``.
        reason: What is wrong with it.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field} {reason}")


class ApprovalError(UserError):
    """A decision on a deferred approval request cannot be applied as given.

    Attributes:
        request_id: The request at fault (``""`` when the problem is not one request's).
    """

    def __init__(self, message: str, request_id: str = "") -> None:
        self.request_id = request_id
        super().__init__(message)


class ApprovalNotFoundError(ApprovalError):
    """No request with that id waits in the last run of that session and user."""


class ApprovalDecidedError(ApprovalError):
    """The request already has a recorded decision (a decision is final), or its run went
    past the call without one, so that no decision can take effect any more."""


class ApprovalArgumentsError(ApprovalError, ValueError):
    """Arguments given with an approval do not validate against the tool's schema."""


class ConfigurationError(LoomflowError, ValueError):
    """A setting or store URL is invalid, or the parts given do not fit together."""


class StorageError(LoomflowError):
    """Base class of database failures shared by every store (journal, audit, budget, ...)."""


class MigrationError(StorageError):
    """A schema migration failed or the database is newer than this library."""


class LegacyJournalError(MigrationError):
    """A loomflow 0.20 journal cannot be imported: its tables are not laid out as expected.

    Attributes:
        table: The 0.20 table that does not match.
        missing: Columns the import needs that the table lacks.
        unexpected: Columns the table has that the import does not know what to do with.
    """

    def __init__(
        self, table: str, missing: tuple[str, ...] = (), unexpected: tuple[str, ...] = ()
    ) -> None:
        self.table = table
        self.missing = missing
        self.unexpected = unexpected
        problems = []
        if missing:
            problems.append(f"missing column(s) {', '.join(missing)}")
        if unexpected:
            problems.append(f"unexpected column(s) {', '.join(unexpected)}")
        super().__init__(
            f"table {table!r} does not have the loomflow 0.20 layout this release imports "
            f"({'; '.join(problems)}); nothing was imported and the 0.20 tables are unchanged"
        )


class AuditError(LoomflowError):
    """Base class of the audit log's own failures."""


class AuditIntegrityError(AuditError):
    """The stored audit trail is damaged (truncated, unreadable); appending would hide it."""


class ErasureRefusedError(AuditError):
    """The store refused to erase audit payloads: the connection's role lacks the right.

    Erasure rewrites payloads in place, which the least-privilege application role may not
    do; run ``loomflow users forget`` and ``loomflow audit retain`` as the tables' owner.
    """


class LegalHoldError(AuditError):
    """The user is under legal hold, so their data may not be erased (forget, retention).

    Attributes:
        user_id: The user.
        reason: The reason recorded when the hold was placed.
    """

    def __init__(self, message: str, *, user_id: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.user_id = user_id
        self.reason = reason


class ProtectedChainError(AuditError):
    """The chain is the console's record of who looked at what (user id ``console:<name>``):
    forgetting it would erase that record, so ``forget_user`` refuses it.

    Attributes:
        user_id: The chain named.
    """

    def __init__(self, message: str, *, user_id: str | None = None) -> None:
        super().__init__(message)
        self.user_id = user_id


class ReservedActionError(UserError):
    """An audit entry given by application code (``AuditLog.record()``, ``AuditStore.append()``)
    uses an action loomflow keeps for its own entries (``audit.*``, ``legal_hold.*``,
    ``console.*`` or one that reads like them) or a console chain's user id
    (``console:<name>``): verification, erasure and holds act on those, so a forged one would
    pass for a hold, an erasure or a look.

    Attributes:
        action: The action refused (cut at 80 characters).
        user_id: The user id of the entry.
    """

    def __init__(self, message: str, *, action: str = "", user_id: str | None = None) -> None:
        super().__init__(message)
        self.action = action
        self.user_id = user_id


class UnknownUserError(UserError):
    """No store holds anything about this user (nothing to forget, no trail to hold)."""


class CheckpointError(LoomflowError):
    """A checkpoint exists but cannot be read back (damaged, or from a newer loomflow)."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint with the given id exists for this (session, user)."""


class JournalError(LoomflowError):
    """Base class of the journal's own failures."""


class JournalEncodeError(JournalError, TypeError):
    """A step's inputs or result contain a value the journal codec cannot encode."""

    def __init__(self, step: str, type_name: str, where: str, reason: str | None = None) -> None:
        self.step = step
        self.type_name = type_name
        self.where = where
        self.reason = reason
        if reason is not None:
            super().__init__(f"step {step!r}: {where} {reason}")
            return
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


class NewerEntryError(CorruptEntryError):
    """A journal entry was written by a newer loomflow, in an encoding this one cannot read.

    Raised whether or not replay is strict: the entry is most likely sound, so running its
    step again (what a damaged entry costs) could do its side effect twice, and replacing
    the entry would lose what the newer release journaled. Upgrade the process that reads it.
    """


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


class MemoryEntryTooLargeError(CorruptEntryError):
    """A stored memory episode is larger than a recall may return (``history_bytes``).

    Its message names the episode, its session, its size and the cap. A run's recall leaves
    such an episode out (with a warning) rather than load it into every later prompt.
    """


class SessionBusyError(JournalError):
    """Another run kept the (session, user) turn for longer than the wait allows, or holds
    it while the user's data is to be forgotten (``Stores.forget_user``)."""


class OwnershipLostError(JournalError):
    """A newer owner took the (session, user) turn; this run may no longer write."""


class RunCancelledError(OwnershipLostError):
    """The run was cancelled (``runtime.cancel``, ``loomflow runs cancel``); it stopped at a
    step boundary and is never recovered, nor resumed (``resume()`` raises this too)."""

    def __init__(
        self, session_id: str | None, user_id: str | None, message: str | None = None
    ) -> None:
        self.session_id = session_id
        self.user_id = user_id
        super().__init__(
            message
            or f"session {session_id!r} of user {user_id!r} was cancelled; the run stopped at a "
            "step boundary and will not be recovered"
        )


class StoreUnavailableError(StorageError):
    """A store's database failed or could not be reached (the driver error is chained)."""


class StoreLockedError(StoreUnavailableError):
    """Another process held a SQLite file's write lock for longer than the busy timeout.

    ``pid`` is that process when it could be found (Linux), and ``stopped`` tells whether it
    is stopped (SIGSTOP, a debugger): a stopped holder keeps every writer out until it is
    continued or ended.
    """

    def __init__(self, message: str, *, path: str, pid: int | None, stopped: bool) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid
        self.stopped = stopped


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


class ModelRetryExhaustedError(ModelError):
    """Every attempt at a model call hit a transient failure (429, 5xx, connection loss)."""

    def __init__(
        self, provider: str, model: str, detail: str, status: int | None = None, attempts: int = 1
    ) -> None:
        super().__init__(provider, model, detail, status)
        self.attempts = attempts
        where = f"HTTP {status}" if status is not None else "connection failure"
        self.args = (
            f"{provider} model {model!r} failed after {attempts} "
            f"{'attempt' if attempts == 1 else 'attempts'}; last error "
            f"({where}): {detail}",
        )


class ScriptExhaustedError(ModelError):
    """A scripted test model was asked for more turns than its script holds."""


class OutputValidationError(LoomflowError):
    """The model's final answer did not validate into the run's ``output_type``.

    Raised once the answer failed validation and every retry (``output_retries``) was spent;
    the model calls made are journaled, so a resume raises it again without calling the model.

    Attributes:
        output_type: The name of the pydantic model the answer had to fit.
        detail: The last validation error.
        attempts: How many answers were validated and refused.
        output: The last refused answer (its first 2000 characters).
    """

    def __init__(self, output_type: str, detail: str, attempts: int = 1, output: str = "") -> None:
        self.output_type = output_type
        self.detail = detail
        self.attempts = attempts
        self.output = output[:2000]
        super().__init__(
            f"the final answer did not fit {output_type} after {attempts} attempt(s); "
            f"last error: {detail}"
        )


class SubAgentInterruptedError(LoomflowError):
    """An agent used as a tool (``as_tool()``, a ``Team`` worker) was interrupted before it
    answered (a budget cap, a guardrail, ``max_turns``).

    Raised inside the tool, so the calling agent's model reads it as the call's tool error
    instead of an empty answer it would take for the sub-agent's work.
    """


class BudgetError(LoomflowError):
    """Base class of the budget's refusals and failures."""


class BudgetExceededError(BudgetError):
    """A model call would cross a cap; agents turn it into a ``budget:<cap>`` interruption.

    Attributes:
        cap: The cap's name, e.g. ``"user.tokens_total.daily"``.
        limit: The cap's limit (tokens, USD or seconds).
        used: What was already spent when the call asked.
        reserved: What calls in flight held at that moment.
        requested: What the refused call asked to reserve.
    """

    def __init__(
        self, cap: str, limit: float, used: float, reserved: float, requested: float
    ) -> None:
        self.cap = cap
        self.limit = limit
        self.used = used
        self.reserved = reserved
        self.requested = requested
        super().__init__(
            f"budget cap {cap} ({limit:g}) reached: {used:g} used, {reserved:g} reserved by "
            f"calls in flight, {requested:g} requested"
        )


class BudgetUnavailableError(BudgetError):
    """The budget store could not be reached, so the model call was refused (fail closed)."""


class InvalidUsageError(BudgetError, ValueError):
    """A token count, cost or limit is negative, NaN, infinite or implausibly large."""


class UntrustedUsageError(InvalidUsageError):
    """A model answered but reported a token count that cannot be true (negative, not a number,
    or more than any call reads or writes).

    Raised by the provider adapters in place of the response: what the call spent is unknown,
    so a budget charges the call's whole reservation, as for any usage it does not trust.
    """


class UnknownModelPriceError(BudgetError):
    """A cost cap cannot be kept: the model called is in no price table the budget was given."""
