"""Deferred approvals: a tool call that needs a person stops the run, durably.

With ``StandardPermissions(..., approval="defer")`` an ``ask`` does not wait in the process.
The permission hook journals the request as a step of the run (``approval_request_<turn>_
<slot>``) and raises :class:`ApprovalPending`; the loop lets the other calls of the turn
finish, then returns an interrupted result (``interruption_reason="approval"``) listing every
request of the turn. Nothing is held while a person thinks: no worker, no session turn, no
budget reservation (reservations live only around a model call, and the run has none open).

A decision is journaled too, as a step of the same run (``approval_decision_<turn>_<slot>_
<request id>``, whose input is the request id), by :func:`journal_decisions`, before the run
is resumed. The resumed run replays what it had done, reaches the tool step again, finds the
request step and then the decision step in the journal, and applies the decision: an allowed
call runs (once: its result is journaled like any tool step), a denied one reaches the model as
a ``permission_denied`` tool error. A request without a recorded decision stops the run again,
with the same id, because the id is a hash of the request's place in the journal.

Everything here reads the journal as untrusted data: rows are decoded by the journal's codec
and validated into plain models; nothing is imported or run.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic_core import to_json

from .._ids import check_id, user_label
from .._json import valid_value
from .._printable import shown
from .._timefmt import iso_time
from ..context import reset_var
from ..errors import (
    ApprovalArgumentsError,
    ApprovalDecidedError,
    ApprovalError,
    ApprovalNotFoundError,
    CorruptEntryError,
    InvalidArgumentTypeError,
    InvalidIdError,
    NewerEntryError,
    PayloadTooLargeError,
    RunCancelledError,
    UserError,
)
from ..hooks import Interrupt, RunInfo
from ..messages import ToolCall
from ..redaction import PLACEHOLDER, Redactor
from ..runtime import codec
from ..runtime._journal import JournalRun, JournalRuntime, _Frame, _frame
from ..runtime._store import Scope, StoredEntry, fingerprint, path_key
from .events import ApprovalRequested

__all__ = [
    "APPROVAL",
    "ApprovalPending",
    "Approve",
    "DamagedRequest",
    "DecisionLike",
    "Deny",
    "PendingApproval",
    "RecordedDecision",
    "journal_decisions",
    "journaled_request",
    "normalize_decision",
    "read_approvals",
]

APPROVAL = "approval"
"""``RunResult.interruption_reason`` of a run stopped for approvals."""

_REQUEST_STEP = "approval_request_"
_DECISION_STEP = "approval_decision_"
# The journal name of a tool call (runtime._names.tool_step_name): its turn and slot.
_TOOL_STEP = re.compile(r"tool_call_(\d+)_(\d+)_[0-9a-f]+")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PendingApproval(_Frozen):
    """A tool call waiting for a person's decision (``RunResult.pending_approvals``).

    Attributes:
        request_id: Stable id of the request: the same on every resume of the run.
        tool: The tool the model asked for.
        arguments: Its arguments, with sensitive values and secrets redacted.
        reason: Why the call needs approval (the rule or mode that asked).
        policy: Which policy asked (``global``, ``role:<name>``, ``user:<id>``).
        sensitive: The argument names the tool declares sensitive, so that whoever decides
            without the tool at hand (the command line) still redacts edited values.
        session_id: The session of the run.
        user_id: Whom the run works for.
        run_id: The run that first stopped at this call.
        agent: The agent's name.
        turn: The model turn that asked for the call.
        slot: The call's place among that turn's calls.
        epoch: The journal epoch of the run (a later new run has a higher one).
        path: The sub-run path of the run in the journal (empty for an outermost run).
        requested_at: When the run first stopped at this call (UTC, ISO 8601).
    """

    request_id: str
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    reason: str = ""
    policy: str = ""
    sensitive: list[str] = Field(default_factory=list)
    session_id: str
    user_id: str | None = None
    run_id: str = ""
    agent: str = ""
    turn: int = Field(ge=0)
    slot: int = Field(ge=0)
    epoch: int = Field(ge=0)
    path: list[str] = Field(default_factory=list)
    requested_at: str = ""


class RecordedDecision(_Frozen):
    """A decision as journaled: what was decided on a request, by whom and when."""

    request_id: str
    behavior: Literal["allow", "deny"]
    arguments: dict[str, Any] | None = None  # edited arguments of an allow
    reason: str = ""
    decided_by: str | None = None
    decided_at: str = ""

    @field_validator("decided_by")
    @classmethod
    def _approver(cls, value: str | None) -> str | None:
        # Read back from the journal: a name no decision could have been given under (a
        # control character, over the id limit) is a damaged record, not an audit actor.
        try:
            return check_id("decided_by", value)
        except InvalidIdError as exc:
            raise ValueError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Approve:
    """Allow the call, optionally with ``arguments`` instead of the model's (an edit)."""

    arguments: Mapping[str, Any] | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Deny:
    """Refuse the call; ``reason`` reaches the model in the ``permission_denied`` error."""

    reason: str = ""


DecisionLike: TypeAlias = Approve | Deny | Literal["allow", "deny"]
"""What ``agent.resume(approvals={request_id: ...})`` accepts for one request."""


def _now() -> str:
    """Now, as every time loomflow writes for people and scripts (``...T12:00:00.123456Z``)."""
    return iso_time(dt.datetime.now(dt.UTC))


def normalize_decision(
    request_id: str, decision: object, decided_by: str | None
) -> RecordedDecision:
    """``decision`` (``Approve``, ``Deny``, ``"allow"`` or ``"deny"``) as it is journaled."""
    # Whoever decided becomes the audit entry's actor: the same rules as for ids.
    check_id("decided_by", decided_by)
    now = _now()
    if decision == "allow":
        decision = Approve()
    elif decision == "deny":
        decision = Deny()
    if isinstance(decision, Approve | Deny) and not isinstance(decision.reason, str):
        # As for an in-process Approval: str() would journal a repr ("None") as the reason
        # the model is given.
        raise InvalidArgumentTypeError(
            f"approval {request_id!r}: a decision's reason must be text, not "
            f"{type(decision.reason).__name__}"
        )
    if isinstance(decision, Approve):
        arguments = decision.arguments
        if arguments is not None and not isinstance(arguments, Mapping):
            raise InvalidArgumentTypeError(
                f"approval {request_id!r}: arguments must be a mapping of argument names to "
                f"values, not {type(arguments).__name__}"
            )
        if arguments is not None:
            for name in arguments:
                if not isinstance(name, str):  # a decision journals names as JSON object keys
                    raise InvalidArgumentTypeError(
                        f"approval {request_id!r}: argument names are strings, not {name!r}"
                    )
        # Text as the model's arguments are kept: a lone surrogate becomes U+FFFD.
        try:
            edited = valid_value(dict(arguments)) if arguments is not None else None
            codec.canonical_bytes(edited)  # refuses nesting deeper than codec.MAX_DEPTH
            _finite(edited)
            # As the decision is journaled (model_dump(mode="json")): bytes become UTF-8
            # text there, so bytes that are not UTF-8 cannot be recorded.
            to_json(edited)
        except RecursionError:  # too deep for the walk that cleans its text: far too deep
            raise InvalidArgumentTypeError(
                f"approval {request_id!r}: edited arguments must be JSON values (nested more "
                f"than {codec.MAX_DEPTH} containers deep)"
            ) from None
        except (codec.UnsupportedValueError, ValueError) as exc:
            raise InvalidArgumentTypeError(
                f"approval {request_id!r}: edited arguments must be JSON values ({exc})"
            ) from None
        return RecordedDecision(
            request_id=request_id,
            behavior="allow",
            arguments=edited,
            reason=decision.reason,
            decided_by=decided_by,
            decided_at=now,
        )
    if isinstance(decision, Deny):
        return RecordedDecision(
            request_id=request_id,
            behavior="deny",
            reason=decision.reason,
            decided_by=decided_by,
            decided_at=now,
        )
    raise InvalidArgumentTypeError(
        f"approval {request_id!r}: a decision is Approve(...), Deny(reason) or the string "
        f"'allow' or 'deny', not {decision!r}"
    )


def _finite(value: Any) -> None:
    """Raise ``ValueError`` for a NaN or an infinity anywhere in ``value``: no JSON number
    spells one, so the decision would keep ``null`` in its place."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a JSON number")
    if isinstance(value, Mapping):
        for item in value.values():
            _finite(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _finite(item)


class ApprovalPending(Interrupt):
    """Raised from a tool step whose call waits for a decision; the loop collects these."""

    def __init__(self, requests: list[PendingApproval]) -> None:
        self.requests = requests
        super().__init__(APPROVAL, ", ".join(r.request_id for r in requests))


# -- inside a run: the permission hook's side -----------------------------------------------


class _Undecided(Exception):
    """The decision step has no journal entry: nobody decided yet."""


def _undecided(request_id: str) -> RecordedDecision:
    raise _Undecided(request_id)


def _position(info: RunInfo) -> tuple[JournalRun, tuple[str, ...]]:
    runtime = info.runtime
    run = runtime.current_run if runtime is not None else None
    frame = _frame.get()
    if not isinstance(run, JournalRun) or frame is None:
        raise UserError(
            "StandardPermissions(approval='defer') needs a journaled runtime (InMemoryRuntime, "
            "SqliteRuntime or PostgresRuntime): the request and its decision are journal steps"
        )
    return run, frame.path


def _request_id(run: JournalRun, path: tuple[str, ...], step: str, inputs: list[Any]) -> str:
    """A hash of the request's place in the journal and of what it asks."""
    return _id_of(run.scope, run.epoch, path, step, inputs)


def _id_of(scope: Scope, epoch: int, path: Sequence[str], step: str, inputs: list[Any]) -> str:
    where = [scope.key, epoch, list(path), step, inputs]
    return "apr_" + hashlib.sha256(codec.canonical_bytes(where)).hexdigest()[:24]


def _edited(request: PendingApproval, scope: Scope, epoch: int, step: str) -> str | None:
    """Why a request read back from the journal is not what was asked, or ``None``: its id
    is a hash of its place and of the tool, arguments, reason and policy it showed, so a
    record whose fields were changed afterwards (in the database) no longer matches its id."""
    asked = [request.tool, request.arguments, request.reason, request.policy]
    try:
        expected = _id_of(scope, epoch, request.path, step, asked)
    except codec.UnsupportedValueError:
        return "its arguments hold a value no request could show"
    if expected != request.request_id:
        return (
            "its tool, arguments, reason or policy differ from what the run asked (they were "
            "changed after it was journaled)"
        )
    return None


async def deferred_decision(
    info: RunInfo,
    turn: int,
    slot: int,
    call: ToolCall,
    shown: dict[str, Any],
    reason: str,
    policy: str,
    sensitive: Iterable[str] = (),
) -> RecordedDecision:
    """The journaled decision on this call; raises :class:`ApprovalPending` while there is none.

    The first time, the request is journaled (and announced with ``ApprovalRequested``).
    ``shown`` is the call's arguments with the tool's sensitive ones redacted; secrets the
    run's redactor knows are scrubbed here too. ``sensitive`` (the tool's sensitive argument
    names) is recorded with the request, outside its id, for redacting edits later.
    """
    run, path = _position(info)
    runtime = info.runtime
    assert runtime is not None  # _position checked it
    if path:
        # An agent running inside another run: its result is that run's (a tool call's,
        # journaled as one value), so a later decision could never reach it. Fail closed.
        return RecordedDecision(
            request_id="",
            behavior="deny",
            reason="approval='defer' cannot wait inside a sub-run (an agent used as a tool, a "
            "team worker, a debater or a workflow node); the call needs approval and is denied",
        )
    arguments = shown_arguments(info.redactor, shown)
    step = f"{_REQUEST_STEP}{turn}_{slot}"
    inputs: list[Any] = [call.name, arguments, reason, policy]
    request_id = _request_id(run, path, step, inputs)

    def ask(request_id: str, tool_name: str, arguments: dict[str, Any], *_: Any) -> dict[str, Any]:
        request = PendingApproval(
            request_id=request_id,
            tool=tool_name,
            arguments=arguments,
            reason=reason,
            policy=policy,
            sensitive=sorted(sensitive),
            session_id=info.session_id,
            user_id=info.user_id,
            run_id=info.run_id,
            agent=info.agent_name,
            turn=turn,
            slot=slot,
            epoch=run.epoch,
            path=list(path),
            requested_at=_now(),
        )
        info.emit(
            ApprovalRequested(
                request_id=request_id,
                tool=tool_name,
                turn=turn,
                slot=slot,
                reason=reason,
                policy=policy,
                arguments=arguments,
            )
        )
        return request.model_dump(mode="json")

    stored = await runtime.step(step, ask, request_id, *inputs)
    request: PendingApproval = _validated(PendingApproval, stored, step)
    if request.request_id != request_id:
        raise CorruptEntryError(f"journal entry {step!r} names another approval request")
    problem = _misplaced(request, run.scope, run.epoch, path_key(path), step)
    if problem is None:
        problem = _not_the_call(request, call.name, arguments, reason, policy)
    if problem is not None:
        raise CorruptEntryError(f"journal entry {step!r} is a damaged approval request: {problem}")
    decided = f"{_DECISION_STEP}{turn}_{slot}_{request_id}"
    if (path_key(path), decided) not in run.entries:
        raise ApprovalPending([request])  # nobody decided yet (looked up without a step)
    try:
        raw = await runtime.step(decided, _undecided, request_id)  # a hit: the decision
    except _Undecided:  # an unreadable entry the journal chose to run again
        raise ApprovalPending([request]) from None
    recorded: RecordedDecision = _validated(RecordedDecision, raw, decided)
    if recorded.request_id != request_id:
        raise CorruptEntryError(f"journal entry {decided!r} decides another approval request")
    return recorded


def journaled_request(info: RunInfo, turn: int, slot: int) -> PendingApproval | None:
    """The sound approval request this run journaled for its call at (``turn``, ``slot``),
    if any; ``None`` outside a journaled run.

    For a call whose sealed arguments this process does not hold (the run resumed in another
    process): its rules cannot be judged on placeholders, but a decision journaled on the
    request it made can still be applied.
    """
    try:
        run, path = _position(info)
    except UserError:
        return None
    stored = run.entries.get((path_key(path), f"{_REQUEST_STEP}{turn}_{slot}"))
    if not stored:
        return None
    ledger = _ledger(run.scope, run.epoch, stored.values())
    for request in ledger.requests.values():
        if request.turn == turn and request.slot == slot and not request.path:
            return request
    return None


_ARGUMENTS = TypeAdapter(dict[str, Any])


def _not_the_call(
    request: PendingApproval, tool: str, arguments: dict[str, Any], reason: str, policy: str
) -> str | None:
    """What of ``request`` differs from the call it was journaled for, or ``None``.

    The journal finds the request by the call (its fingerprint hashes the tool, the arguments,
    the reason and the policy), and the request id hashes them too, but the record's own
    fields are what people are shown and decide on. A record whose fields were edited in the
    database would have a person approve one call while another runs.
    """
    if request.tool != tool:
        return f"it names tool {request.tool!r}, but the call is to {tool!r}"
    shown = _ARGUMENTS.dump_python(arguments, mode="json")  # as the record was written
    if codec.canonical_bytes(request.arguments) != codec.canonical_bytes(shown):
        return "its arguments are not the call's arguments"
    if request.reason != reason or request.policy != policy:
        return "its reason or policy is not the one that asked for approval"
    return None


def _misplaced(
    request: PendingApproval, scope: Scope, epoch: int, path: str, name: str
) -> str | None:
    """What places ``request`` elsewhere than the journal entry it was read from, or ``None``.

    A request names its session, user, run epoch, sub-run path, turn and slot; the journal row
    holding it has all of these from where it is stored. A record that disagrees was edited
    (or copied from another user's run): deciding on it would audit and journal the decision
    in a place the run never looks, or under someone else's name.
    """
    if request.session_id != scope.session_id:
        return (
            f"it names session {request.session_id!r}, but is stored in session "
            f"{scope.session_id!r}"
        )
    if request.user_id != scope.user_id:
        return (
            f"it names {user_label(request.user_id)}, but is stored in the session of "
            f"{user_label(scope.user_id)}"
        )
    if request.epoch != epoch:
        return f"it names run epoch {request.epoch}, but is stored in epoch {epoch}"
    if path_key(request.path) != path:
        return f"it names sub-run path {request.path!r}, but is stored at another"
    if f"{_REQUEST_STEP}{request.turn}_{request.slot}" != name:
        return f"it names turn {request.turn} slot {request.slot}, but is stored as {name!r}"
    return None


def shown_arguments(redactor: Redactor | None, shown: dict[str, Any]) -> dict[str, Any]:
    """The arguments as people may see them: sensitive names and secrets redacted. Both a
    deferred request and an in-process approval handler are shown this."""
    if redactor is not None:
        value = redactor.value(shown)
        if isinstance(value, dict):
            shown = value
    return shown


def _validated(model: type[Any], value: object, step: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise CorruptEntryError(
            f"journal entry {step!r} is not an approval record: {exc.errors()[0]['msg']}"
        ) from None


# -- outside a run: listing requests and recording decisions --------------------------------


@dataclass(frozen=True, slots=True)
class DamagedRequest:
    """A journaled approval request that cannot be trusted: listed, never decided.

    Attributes:
        step: The journal step that holds it (``approval_request_<turn>_<slot>``).
        request_id: The id it names, when that much reads (else ``None``).
        session_id: The session it is stored in.
        user_id: The user it is stored under.
        problem: What is wrong with it.
        newer_codec: The codec version a newer loomflow wrote it (or its decision) with, when
            that is why it cannot be read: the record is most likely sound, and the newer
            release can decide it.
    """

    step: str
    request_id: str | None
    session_id: str | None
    user_id: str | None
    problem: str
    newer_codec: int | None = None


@dataclass(slots=True)
class Ledger:
    """The approval requests and decisions of one run of a (session, user)."""

    epoch: int | None = None
    requests: dict[str, PendingApproval] = field(default_factory=dict)
    decisions: dict[str, RecordedDecision] = field(default_factory=dict)
    cancelled: bool = False  # the run was cancelled: nothing of it waits any more
    # The run went on to its answer: a request still undecided in it (one the run stopped
    # at before its model call was made again, and no longer reached) waits for nothing.
    finished: bool = False
    # Request rows that do not read as a request of this run: the run's resume refuses them.
    damaged: list[DamagedRequest] = field(default_factory=list)
    # The request rows a newer loomflow wrote (also in ``damaged``), with their stored value,
    # in which an id a person gives is looked for (see :func:`_newer_request`).
    newer: list[tuple[DamagedRequest, bytes]] = field(default_factory=list)
    # (sub-run path key, turn, slot) of the tool calls whose outcome is journaled, with the
    # journal position of the last such outcome.
    settled: dict[tuple[str, int, int], int] = field(default_factory=dict)
    # The journal position of each request's row.
    asked_at: dict[str, int] = field(default_factory=dict)

    def is_settled(self, request: PendingApproval) -> bool:
        """Whether the request's call already has a journaled outcome, reached without a
        decision on it (a resume after the policy changed no longer asked, or asked in other
        words): no decision on it can take effect any more.

        Only an outcome journaled after the request counts: one from before it belongs to
        another call at that place (the run's model call was made again after a change of
        instructions, and asked for something else there), and the run still waits."""
        done = self.settled.get((path_key(request.path), request.turn, request.slot))
        return done is not None and done > self.asked_at.get(request.request_id, -1)

    @property
    def pending(self) -> list[PendingApproval]:
        """Requests without a decision, in the order the model asked for them."""
        if self.cancelled or self.finished:
            return []
        waiting = [
            r
            for r in self.requests.values()
            if r.request_id not in self.decisions and not self.is_settled(r)
        ]
        return sorted(waiting, key=lambda r: (r.path, r.turn, r.slot))


def _ledger(scope: Scope, epoch: int, entries: Iterable[StoredEntry]) -> Ledger:
    ledger = Ledger(epoch)
    # Decision rows that read but are no decision on their request (see _damaged_decisions).
    shapeless: list[tuple[StoredEntry, str]] = []
    found: list[tuple[RecordedDecision, StoredEntry]] = []  # decisions, and their rows
    newer_decisions: list[StoredEntry] = []
    for entry in entries:
        if entry.damaged() is not None:
            continue  # a hand-edited row no step matches: the run would journal it again
        tool_step = _TOOL_STEP.fullmatch(entry.name)
        if tool_step is not None:
            call_at = (entry.path, int(tool_step[1]), int(tool_step[2]))
            ledger.settled[call_at] = max(entry.seq, ledger.settled.get(call_at, -1))
            continue
        is_request = entry.name.startswith(_REQUEST_STEP)
        if not is_request and not entry.name.startswith(_DECISION_STEP):
            continue
        if entry.format != "pickle" and entry.codec_version > codec.CODEC_VERSION:
            # The run's resume stops here with NewerEntryError (it never asks again).
            if is_request:
                newer = _damaged(
                    scope,
                    entry.name,
                    None,
                    f"a newer loomflow wrote it (codec v{entry.codec_version}); "
                    "upgrade this process to read it",
                    newer_codec=entry.codec_version,
                )
                ledger.damaged.append(newer)
                ledger.newer.append((newer, entry.value))
            else:
                newer_decisions.append(entry)
            continue
        if entry.format != "json":
            continue  # the journal skips such rows too: the step would run again
        try:
            value = codec.loads(entry.value, version=entry.codec_version)
        except (codec.UnknownTagError, ValueError, RecursionError):
            if is_request:  # the run's resume stops at it with CorruptEntryError
                ledger.damaged.append(
                    _damaged(scope, entry.name, None, "its value does not decode")
                )
            continue
        if is_request:
            _add_request(ledger, scope, epoch, entry, value)
            continue
        try:
            decision = RecordedDecision.model_validate(value)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"]) or "the record"
            shapeless.append((entry, f"it is not a decision record ({where}: {error['msg']})"))
            continue
        if not entry.name.endswith(f"_{decision.request_id}"):
            shapeless.append((entry, "it decides another request than the one it is stored for"))
            continue
        found.append((decision, entry))
    for decision, entry in found:
        request = ledger.requests.get(decision.request_id)
        # Only the row the run reads back at the request decides it: one it never reads
        # (moved to another turn or slot, keyed by other inputs) leaves the run waiting, so
        # the request must stay open to a decision instead of being shown as decided.
        if request is None or _read_by_run(entry, request):
            ledger.decisions[decision.request_id] = decision
    _damaged_decisions(ledger, scope, shapeless)
    _newer_decisions(ledger, scope, newer_decisions)
    return ledger


def _read_by_run(entry: StoredEntry, request: PendingApproval) -> bool:
    """Whether ``entry`` is the journal row the run reads back as the decision on ``request``
    (its step name, sub-run path and inputs)."""
    return (
        entry.name == f"{_DECISION_STEP}{request.turn}_{request.slot}_{request.request_id}"
        and entry.path == path_key(request.path)
        and entry.fingerprint == fingerprint([request.request_id], {})
    )


def _damaged_decisions(
    ledger: Ledger, scope: Scope, shapeless: list[tuple[StoredEntry, str]]
) -> None:
    """Mark damaged the requests whose decision step holds a row that is no decision.

    The run's resume reads that row back at the request (a journal hit) and stops with
    CorruptEntryError; deciding again would hit the same row and journal nothing while
    auditing a decision that never takes effect. So the request is listed as unreadable and
    refused, like a damaged request.
    """
    for entry, problem in shapeless:
        for request in list(ledger.requests.values()):
            if _read_by_run(entry, request):
                _decided_unreadably(ledger, scope, request, f"is damaged: {problem}")


def _newer_decisions(ledger: Ledger, scope: Scope, entries: list[StoredEntry]) -> None:
    """Mark unreadable the requests whose decision step holds a row a newer loomflow wrote.

    The newer release decided them (it may fingerprint the id differently, so the step's name
    and sub-run decide): the run's resume stops at that row with NewerEntryError, so the
    request no longer waits for this release, which must neither list it as waiting nor
    audit a decision of its own that could never take effect."""
    for entry in entries:
        for request in list(ledger.requests.values()):
            step = f"{_DECISION_STEP}{request.turn}_{request.slot}_{request.request_id}"
            if entry.name == step and entry.path == path_key(request.path):
                why = (
                    f"was written by a newer loomflow (codec v{entry.codec_version}); upgrade "
                    "this process to read it"
                )
                _decided_unreadably(ledger, scope, request, why, entry.codec_version)


def _decided_unreadably(
    ledger: Ledger,
    scope: Scope,
    request: PendingApproval,
    problem: str,
    newer_codec: int | None = None,
) -> None:
    """Move ``request`` from the requests to the damaged ones: its decision row ``problem``."""
    del ledger.requests[request.request_id]
    ledger.decisions.pop(request.request_id, None)
    step = f"{_DECISION_STEP}{request.turn}_{request.slot}_{request.request_id}"
    ledger.damaged.append(
        _damaged(
            scope,
            f"{_REQUEST_STEP}{request.turn}_{request.slot}",
            request.request_id,
            f"its decision (journal entry {step!r}) {problem}",
            newer_codec,
        )
    )


# What an approval request id looks like (see _id_of): only such an id is looked for in the
# stored value of a request a newer loomflow wrote, where a short one ("", "1") would match
# anything.
_REQUEST_ID = re.compile(r"apr_[0-9a-f]{24}")


def _newer_request(ledger: Ledger, request_id: str) -> DamagedRequest | None:
    """The request row a newer loomflow wrote that names ``request_id``, or ``None``.

    Its value is not decoded (this release cannot read that codec version), only searched for
    the id as a JSON string: every record a loomflow writes is JSON holding its id."""
    if _REQUEST_ID.fullmatch(request_id) is None:
        return None
    quoted = f'"{request_id}"'.encode()
    for damaged, value in ledger.newer:
        if isinstance(value, bytes | bytearray | memoryview) and quoted in bytes(value):
            return damaged
    return None


def _add_request(
    ledger: Ledger, scope: Scope, epoch: int, entry: StoredEntry, value: object
) -> None:
    named = value.get("request_id") if isinstance(value, dict) else None
    request_id = named if isinstance(named, str) else None
    try:
        request = PendingApproval.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the record"
        why = f"it is not an approval record ({where}: {error['msg']})"
        ledger.damaged.append(_damaged(scope, entry.name, request_id, why))
        return
    problem = _misplaced(request, scope, epoch, entry.path, entry.name)
    if problem is None:
        problem = _edited(request, scope, epoch, entry.name)
    twin = ledger.requests.get(request.request_id)
    if problem is None and twin is not None:
        problem = "another journal entry names the same request"
        del ledger.requests[request.request_id]
        step = f"{_REQUEST_STEP}{twin.turn}_{twin.slot}"
        ledger.damaged.append(_damaged(scope, step, twin.request_id, problem))
    if problem is not None:
        ledger.damaged.append(_damaged(scope, entry.name, request.request_id, problem))
        ledger.requests.pop(request.request_id, None)  # that id is not to be decided
    elif not any(d.request_id == request.request_id for d in ledger.damaged):
        ledger.requests[request.request_id] = request
        ledger.asked_at[request.request_id] = entry.seq


def _damaged(
    scope: Scope, step: str, request_id: str | None, problem: str, newer_codec: int | None = None
) -> DamagedRequest:
    return DamagedRequest(step, request_id, scope.session_id, scope.user_id, problem, newer_codec)


async def read_approvals(runtime: JournalRuntime, session_id: str, user_id: str | None) -> Ledger:
    """The requests and decisions of the last run of (session, user), read from the journal.

    Works in any process that reaches the journal's database; reads only (no turn is taken).
    """
    scope = Scope.checked(session_id, user_id)
    sessions = await runtime.sessions(user_id=user_id, session_id=session_id, limit=1)
    if not sessions:
        return Ledger()
    info = sessions[0]
    epoch = info.epoch if info.open else info.epoch - 1
    if epoch < 0:
        return Ledger()
    rows = await runtime._store.load_run(scope, epoch)
    ledger = _ledger(scope, epoch, rows)
    ledger.cancelled = info.state == "cancelled"
    ledger.finished = info.state == "finished"
    return ledger


def check_decidable(
    ledger: Ledger, request_ids: Iterable[str], session: str, user: str | None
) -> None:
    """Raise unless every id names a request of ``ledger`` that has no decision yet."""
    if ledger.cancelled:
        # "While it waited" only of a run that had requests: one cancelled mid-step asked
        # nobody anything.
        why = (
            "while it waited for approval; its requests can no longer be decided"
            if ledger.requests
            else "and its last run asked for no approval"
        )
        raise RunCancelledError(
            session,
            user,
            f"session {session!r} of {user_label(user)} was cancelled {why} (a new run of the "
            "session starts afresh)",
        )
    for request_id in request_ids:
        if not isinstance(request_id, str):
            raise InvalidArgumentTypeError(
                f"approval request ids are strings, not {type(request_id).__name__}"
            )
        damaged = [d for d in ledger.damaged if d.request_id == request_id]
        newer = damaged[0] if damaged else _newer_request(ledger, request_id)
        if newer is not None and newer.newer_codec is not None:
            raise _written_by_newer(newer, request_id, session, user)
        if damaged:
            raise CorruptEntryError(
                f"approval request {request_id!r} of session {session!r} of {user_label(user)} "
                f"is damaged (journal entry {damaged[0].step!r}: {damaged[0].problem}); it "
                "cannot be decided, and a resume of the run stops at it"
            )
        if request_id not in ledger.requests:
            unread = (
                f"; the run also holds {len(ledger.newer)} request(s) a newer loomflow wrote, "
                "which this one cannot read (`loomflow approvals list` names them)"
                if ledger.newer
                else ""
            )
            raise ApprovalNotFoundError(
                # Cut: an id pasted wrong (a whole file, say) need not come back whole.
                f"no approval request {shown(request_id, 80)} in the last run of session "
                f"{session!r} "
                f"of {user_label(user)} (pending_approvals() or `loomflow approvals list` shows "
                f"the ones waiting){unread}",
                request_id,
            )
        if request_id in ledger.decisions:
            done = ledger.decisions[request_id]
            raise ApprovalDecidedError(
                f"approval request {request_id!r} was already decided ({done.behavior} by "
                f"{done.decided_by or 'an unnamed approver'} at {done.decided_at}); a decision "
                "is final",
                request_id,
            )
        if ledger.is_settled(ledger.requests[request_id]):
            raise ApprovalDecidedError(
                f"approval request {request_id!r} no longer waits: the run went past its call "
                "without a decision (resumed under a policy that did not ask for it, or asked "
                "in other words), so no decision on it can take effect; nothing was recorded",
                request_id,
            )
        if ledger.finished:
            raise ApprovalDecidedError(
                f"approval request {request_id!r} no longer waits: the run finished without "
                "reaching its call again, so no decision on it can take effect; nothing was "
                "recorded",
                request_id,
            )


def _written_by_newer(
    newer: DamagedRequest, request_id: str, session: str, user: str | None
) -> NewerEntryError:
    return NewerEntryError(
        f"approval request {request_id!r} (journal entry {newer.step!r}) of session "
        f"{session!r} of {user_label(user)} exists, but this loomflow cannot act on it: "
        f"{newer.problem} (this one reads up to codec v{codec.CODEC_VERSION}); nothing was "
        "recorded"
    )


async def journal_decisions(
    runtime: JournalRuntime,
    session_id: str,
    user_id: str | None,
    decisions: Mapping[str, RecordedDecision],
    before_each: Callable[[PendingApproval, RecordedDecision], Awaitable[None]] | None = None,
) -> dict[str, PendingApproval]:
    """Journal ``decisions`` as steps of the last run of (session, user); the requests decided.

    Takes the session's turn while writing, so it waits for a run in progress. All ids are
    checked before anything is written; then each decision is one journal step. The run is
    left in the state it was in (``interrupted``, as it stopped): only a resume continues it.

    ``before_each`` (the audit entry of a decision) is awaited for each decision under the
    turn, after the checks and before any step is written: a decision that takes effect has
    always been audited, and when an audit write fails none of the decisions is journaled
    (the same call can be retried).

    Raises:
        ApprovalNotFoundError: an id is not a request of that run.
        ApprovalDecidedError: a request already has a decision.
        RunCancelledError: the run was cancelled (before or while the decisions were written).
        PayloadTooLargeError: a decision is larger than the journal's per-step cap (nothing
            is audited or journaled).
    """
    if not decisions:
        return {}
    # Checked before the turn is taken: a wrong id must not open (and so close) a run.
    first = await read_approvals(runtime, session_id, user_id)
    check_decidable(first, decisions, session_id, user_id)
    _check_edits(first, decisions)  # a request's arguments are fixed by its id
    problem: ApprovalError | PayloadTooLargeError | None = None
    decided: dict[str, PendingApproval] = {}
    async with runtime.session(session_id, user_id, resume=True, take_turn=True) as run:
        assert isinstance(run, JournalRun)  # an outermost session of a JournalRuntime
        # Writing a decision does not continue the run: closing this block normally would
        # otherwise store it as finished, and it would list so until it is really resumed.
        run.keep_state = True
        ledger = _ledger(
            run.scope, run.epoch, (e for slot in run.entries.values() for e in slot.values())
        )
        steps = {}
        try:
            check_decidable(ledger, decisions, session_id, user_id)  # a racing writer
            for request_id, decision in decisions.items():
                request = ledger.requests[request_id]
                step = f"{_DECISION_STEP}{request.turn}_{request.slot}_{request_id}"
                # Sized as the journal will store it, before anything is audited: a decision
                # too large to journal (a reason of megabytes) must not leave an audit entry
                # for a decision that never took effect.
                runtime._encode(step, decision.model_dump(mode="json"))
                steps[request_id] = step
        except (ApprovalError, PayloadTooLargeError) as exc:
            problem = exc
        else:
            # Every decision is audited before any is journaled: an audit write that fails
            # for the second decision must not leave the first one final, or deciding again
            # (the same call, once the audit store answers) would be refused as decided.
            if before_each is not None:
                for request_id, decision in decisions.items():
                    await before_each(ledger.requests[request_id], decision)
            for request_id, decision in decisions.items():
                request = ledger.requests[request_id]
                reset = _frame.set(_Frame(run, tuple(request.path)))
                try:
                    await runtime.step(
                        steps[request_id],
                        functools.partial(_recorded, decision.model_dump(mode="json")),
                        request_id,
                    )
                finally:
                    reset_var(_frame, reset)
                decided[request_id] = request
    if problem is not None:  # raised outside the block, so the run is left as it was
        raise problem
    return decided


_REDACTED = PLACEHOLDER[:-1]  # "[REDACTED", which "[REDACTED:<kind>]" begins with too


def _check_edits(ledger: Ledger, decisions: Mapping[str, RecordedDecision]) -> None:
    """Raise :class:`ApprovalArgumentsError` for an edit that keeps a redacted value.

    A request shows sensitive values and secrets as ``[REDACTED]`` (``[REDACTED:<kind>]``).
    An edit replaces every argument, so one made by copying the request's arguments and
    changing another value would run the tool with the placeholder as the value.
    """
    for request_id, decision in decisions.items():
        if decision.arguments is None:
            continue
        kept = kept_placeholder(ledger.requests[request_id].arguments, decision.arguments)
        if kept is not None:
            where, value = kept
            raise ApprovalArgumentsError(
                f"approval {request_id!r}: edited argument {where!r} is {shown(value, 80)}, "
                "the request's redacted value, not a value to run the tool with: an edit "
                "replaces every argument, so give the real value (or approve without edited "
                "arguments to run the call as the model asked)",
                request_id,
            )


def kept_placeholder(asked: Any, edited: Any, where: str = "") -> tuple[str, str] | None:
    """Where ``edited`` holds, at the same place, a value of ``asked`` (the request's
    arguments) that was redacted."""
    if isinstance(asked, str):
        return (where, asked) if asked == edited and _REDACTED in asked else None
    pairs: Iterable[tuple[Any, Any, str]] = ()
    if isinstance(asked, dict) and isinstance(edited, dict):
        for key in edited:
            if key in asked and isinstance(key, str) and _REDACTED in key:  # a redacted key
                return (f"{where}.{key}" if where else key, key)
        pairs = (
            (asked[k], v, f"{where}.{k}" if where else k) for k, v in edited.items() if k in asked
        )
    elif isinstance(asked, list) and isinstance(edited, list):
        pairs = (
            (a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(asked, edited, strict=False))
        )
    for inner_asked, inner_edited, inner_where in pairs:
        found = kept_placeholder(inner_asked, inner_edited, inner_where)
        if found is not None:
            return found
    return None


def _recorded(value: dict[str, Any], request_id: str) -> dict[str, Any]:
    return value
