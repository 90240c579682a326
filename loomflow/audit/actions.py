"""The actions the agent loop writes to the audit log (the ``action`` field of an entry).

Live work is recorded before it starts and again when it ends, both entries sharing an
``execution`` id: ``model.start`` then ``model.call`` or ``model.error``; ``tool.call`` then
``tool.result``. A start with no end is work a crash cut short. A replayed step is recorded
as ``model.replay`` or ``tool.replay``, never as a new call, so a query for ``tool.call`` lists
exactly the tool executions that really began.
"""

from __future__ import annotations

import unicodedata
from typing import Final

from ..errors import ReservedActionError

__all__ = [
    "ALL",
    "APPROVAL_DECISION",
    "APPROVAL_REQUEST",
    "AUDIT_DELETION",
    "AUDIT_DELETION_START",
    "AUDIT_ERASURE",
    "BUDGET_DENIED",
    "BUDGET_UNAVAILABLE",
    "BUDGET_WARNING",
    "CONSOLE_CHAINS",
    "GUARDRAIL_TRIP",
    "KEPT_BY_ERASURE",
    "LEGAL_HOLD_PLACED",
    "LEGAL_HOLD_RELEASED",
    "MODEL_CALL",
    "MODEL_ERROR",
    "MODEL_REPLAY",
    "MODEL_START",
    "PERMISSION_DECISION",
    "REPLAY_DIVERGENCE",
    "RESERVED_PREFIXES",
    "RUN_CANCEL",
    "RUN_DEAD_LETTER",
    "RUN_END",
    "RUN_RECOVER",
    "RUN_START",
    "TOOL_CALL",
    "TOOL_REPLAY",
    "TOOL_RESULT",
    "refuse_reserved",
    "reserved_lookalike",
]

RUN_START: Final = "run.start"
"""A run took its turn: agent, model, prompt (redacted), epoch, whether it resumed."""
RUN_END: Final = "run.end"
"""A run returned or raised: outcome (``completed``, ``interrupted``, ``failed``, or
``cancelled``: its caller went away or someone cancelled it), usage, cost, interruption reason,
error."""
MODEL_START: Final = "model.start"
"""A live model call is about to be sent: turn, model, its execution id."""
MODEL_CALL: Final = "model.call"
"""A live model call returned: model, tokens, cost, the tools it asked for."""
MODEL_ERROR: Final = "model.error"
"""A live model call failed or was abandoned: error type and message."""
MODEL_REPLAY: Final = "model.replay"
"""A model call answered from the journal (nothing was billed)."""
TOOL_CALL: Final = "tool.call"
"""A live tool call, written before the tool runs: tool, slot, redacted arguments, whether the
tool runs (``executed``; ``False`` when a hook answered instead)."""
TOOL_RESULT: Final = "tool.result"
"""The result of a live tool call, written before it is journaled: ok or error."""
TOOL_REPLAY: Final = "tool.replay"
"""A tool call answered from the journal: the tool did not run again."""
PERMISSION_DECISION: Final = "permission.decision"
"""A permission decision: allow, deny or ask, the reason, the policy, the approver."""
BUDGET_DENIED: Final = "budget.denied"
"""A model call refused by a budget cap (the run ends interrupted)."""
BUDGET_UNAVAILABLE: Final = "budget.unavailable"
"""The budget store failed, so a model call was refused (fail closed)."""
BUDGET_WARNING: Final = "budget.warning"
"""Spend crossed a warning threshold of a cap."""
GUARDRAIL_TRIP: Final = "guardrail.trip"
"""A guardrail blocked or redacted input, output or a tool result."""
REPLAY_DIVERGENCE: Final = "replay.divergence"
"""A resumed run reached a journaled step with other inputs; the step ran fresh."""
APPROVAL_REQUEST: Final = "approval.request"
"""A run stopped at a tool call that waits for a person (``approval="defer"``): request id,
tool, redacted arguments, reason, policy."""
APPROVAL_DECISION: Final = "approval.decision"
"""A person decided a deferred request: request id, allow or deny, reason, when, and the
edited arguments (redacted) if any; the actor is ``approver:<name>``. Written when the decision
is journaled, before the resumed run applies it (``permission.decision`` follows then)."""
RUN_RECOVER: Final = "run.recover"
"""A recoverer (actor ``worker:<id>``) claimed an orphaned run and resumed it: agent, attempt;
written again when the resumed run ends, with its outcome."""
RUN_DEAD_LETTER: Final = "run.dead_letter"
"""A recoverer gave up on a run after its attempts (the run is ``failed``): the last error."""
RUN_CANCEL: Final = "run.cancel"
"""Someone cancelled a run (actor: who asked, e.g. ``cli:<login>``)."""

ALL: Final = (
    RUN_START,
    RUN_END,
    MODEL_START,
    MODEL_CALL,
    MODEL_ERROR,
    MODEL_REPLAY,
    TOOL_CALL,
    TOOL_RESULT,
    TOOL_REPLAY,
    PERMISSION_DECISION,
    BUDGET_DENIED,
    BUDGET_UNAVAILABLE,
    BUDGET_WARNING,
    GUARDRAIL_TRIP,
    REPLAY_DIVERGENCE,
    APPROVAL_REQUEST,
    APPROVAL_DECISION,
    RUN_RECOVER,
    RUN_DEAD_LETTER,
    RUN_CANCEL,
)

AUDIT_ERASURE: Final = "audit.erasure"
"""Payloads of the user's earlier entries were erased (``users forget`` or retention). Its
payload holds no personal data: reason, cut-off, counts, and the digests that keep erased
entries of hash versions 1 and 2 checkable. Erasure never erases it."""
AUDIT_DELETION: Final = "audit.deletion"
"""Data of the user was deleted from a store by an operator, outside an erasure
(``checkpoints forget --user``, ``journal prune --user``): the store, how many rows and the
filters. No personal data; erasure never erases it."""
AUDIT_DELETION_START: Final = "audit.deletion.start"
"""Written before ``journal prune --user`` or ``checkpoints forget --user`` deletes anything:
the store, how many rows it found (``found``) and the filters. The ``audit.deletion`` after
it says how many went; a start with no ``audit.deletion`` after it is a deletion a crash cut
short, which may have deleted some of those rows. Erasure never erases it."""
LEGAL_HOLD_PLACED: Final = "legal_hold.placed"
"""A legal hold was placed on the user: forget and retention refuse to erase until released."""
LEGAL_HOLD_RELEASED: Final = "legal_hold.released"
"""The user's legal hold was released."""

KEPT_BY_ERASURE: Final = (
    AUDIT_ERASURE,
    AUDIT_DELETION,
    AUDIT_DELETION_START,
    LEGAL_HOLD_PLACED,
    LEGAL_HOLD_RELEASED,
)
"""Actions whose payloads erasure leaves in place: the record of erasures, deletions and
holds."""

RESERVED_PREFIXES: Final = ("audit.", "legal_hold.", "console.")
"""Prefixes of the actions loomflow acts on (an erasure record authorises erased payloads, a
hold blocks erasure, the console's entries are its record of looks): ``AuditLog.record``
refuses them."""

# Characters that read as another in a listing: digits and bars as letters, Cyrillic and
# Greek letters as Latin ones, other dots as "."; "_", hyphens and spaces are dropped. Letters
# that look alike map to one ("i" and "l" both to "l"), on both sides of the comparison.
_LOOKALIKES: Final = str.maketrans(
    "1i|\u0131\u0456\u04cf\u03b90\u043e\u03bf"
    "\u00b7\u3002\u30fb\u0430\u03b1\u0435\u03b5\u0440\u03c1\u0441"
    "\u0445\u0443\u043a\u03ba\u0455\u0458\u04bb\u0501\u03c4\u03bd",
    "lllllllooo...aaeeppcxykksjhdtv",
    "_- \u2010\u2011\u2013",
)


def _skeleton(action: str) -> str:
    folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", action).casefold())
    # Invisible characters (zero-width spaces and joiners, Unicode category Cf) are dropped.
    visible = "".join(c for c in folded if unicodedata.category(c) != "Cf")
    return visible.translate(_LOOKALIKES)


def reserved_lookalike(action: str) -> str | None:
    """The reserved prefix (``audit.``, ...) that ``action`` reads as in a listing, or None.

    Compared after NFKC normalisation and case folding, without invisible characters,
    separators (``_``, ``-``, spaces, middle dots) and with common look-alike letters and
    digits made one: ``legaI_hold.placed``, ``AUDIT.erasure`` and ``audit\u2024erasure`` all
    read as reserved actions."""
    skeleton = _skeleton(action)
    for prefix, folded in _RESERVED_SKELETONS:
        if skeleton.startswith(folded):
            return prefix
    return None


# Folded once: record() asks on every entry.
_RESERVED_SKELETONS: Final = tuple((prefix, _skeleton(prefix)) for prefix in RESERVED_PREFIXES)


CONSOLE_CHAINS: Final = "console:"
"""Not an action: the prefix of the user ids of the console's own chains (``console:<name>``),
where each query records who looked at what. Their payloads name the users looked at, so a
forget erases those payloads; the chains themselves cannot be forgotten."""


def refuse_reserved(action: object, user_id: object) -> None:
    """Raise :class:`~loomflow.errors.ReservedActionError` if application code may not write
    an entry with this action or user id: a reserved family (:data:`RESERVED_PREFIXES`), an
    action that reads as one (:func:`reserved_lookalike`), or a console chain's user id.

    ``AuditLog.record()`` and ``AuditStore.append()`` ask it; loomflow's own writers (holds,
    erasure records, deletions, the console) go past it."""
    if isinstance(action, str):
        if action.startswith(RESERVED_PREFIXES):
            raise ReservedActionError(
                f"action {action[:80]!r} is kept for loomflow's own entries: use "
                "place_hold()/release_hold() for holds and Stores.forget_user() or retain() "
                "for erasures, and name your own actions outside audit.*, legal_hold.* and "
                "console.*",
                action=action[:80],
                user_id=user_id if isinstance(user_id, str) else None,
            )
        family = reserved_lookalike(action)
        if family is not None:
            # Listed by `audit query` and the console, it would pass for a hold or an erasure.
            raise ReservedActionError(
                f"action {action[:80]!a} looks like loomflow's own {family}* actions "
                "(compared ignoring case, _ - and spaces, invisible characters and look-alike "
                "letters): name your own actions so they cannot be read as one of those",
                action=action[:80],
                user_id=user_id if isinstance(user_id, str) else None,
            )
    if isinstance(user_id, str) and user_id.startswith(CONSOLE_CHAINS):
        raise ReservedActionError(
            f"user id {user_id[:80]!r} names a console chain (console:<name>), which only "
            "the console writes",
            action=action[:80] if isinstance(action, str) else "",
            user_id=user_id,
        )
