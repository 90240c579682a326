"""The one rule every id handed to loomflow must meet, checked the same way on every backend.

Session ids, user ids, run ids and checkpoint ids end up in primary keys and indexes, several
of them at once (the journal's scope key is both ids JSON-encoded side by side, a sub-run path
may repeat the session id). PostgreSQL refuses a btree entry over 2,704 bytes, and does so
only at write time, with an error that reads like an outage. So ids are checked before any
store is touched:

- a string, never empty;
- at most :data:`MAX_ID_BYTES` bytes in UTF-8 (256 ASCII characters, fewer otherwise);
- no control characters (NUL, which PostgreSQL text cannot hold, tab, newline, DEL and the
  C1 range) and nothing that has no UTF-8 form (lone surrogates).

Worst case under these rules: an id of 256 double quotes JSON-escapes to 514 bytes, so the
widest single index (a memory episode: user key plus an episode key holding both ids, about
1,600 bytes) stays well under the limit. Keys that embed ids (idempotency keys, episode keys)
get :data:`MAX_KEY_BYTES`.
"""

from __future__ import annotations

import unicodedata

from ._printable import id_literal
from .errors import InvalidArgumentError, InvalidArgumentTypeError, InvalidIdError

__all__ = ["MAX_ID_BYTES", "MAX_KEY_BYTES", "check_count", "check_id", "check_key", "user_label"]

MAX_ID_BYTES = 256
"""The longest id (session, user, run, checkpoint), in UTF-8 bytes."""

MAX_KEY_BYTES = 2048
"""The longest idempotency key or memory episode key, in UTF-8 bytes.

Next to a user key (at most 516 bytes) it stays under PostgreSQL's 2,704-byte btree limit.
"""


def _check(field: str, value: object, limit: int, optional: bool) -> str | None:
    if value is None:
        if optional:
            return None
        raise InvalidIdError(field, "must be a non-empty string, not None")
    if not isinstance(value, str):
        raise InvalidIdError(field, f"must be a string, not {type(value).__name__}")
    if not value:
        # An empty id would silently become a fresh session (or a bucket of its own): a
        # redelivered request would then run its side effects again.
        raise InvalidIdError(field, "must not be empty")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidIdError(field, "holds a lone surrogate, which has no UTF-8 form") from None
    if size > limit:
        raise InvalidIdError(field, f"is {size} bytes long in UTF-8, over the {limit}-byte limit")
    if not value.isprintable():  # cheap pre-filter: most ids are plain printable text
        for char in value:
            if unicodedata.category(char) == "Cc":
                name = " (NUL, which PostgreSQL text cannot hold)" if char == "\x00" else ""
                raise InvalidIdError(
                    field, f"contains the control character U+{ord(char):04X}{name}"
                )
    return value


def check_id(field: str, value: object, *, optional: bool = True) -> str | None:
    """Return ``value`` if it is a valid id, ``None`` if it is ``None`` and ``optional``.

    Args:
        field: The argument's name, used in the error (``"session_id"``, ``"user_id"``, ...).
        value: What the caller passed.
        optional: Whether ``None`` is allowed (``user_id=None`` is the anonymous bucket).

    Raises:
        InvalidIdError: ``value`` is empty, not a string, longer than :data:`MAX_ID_BYTES`
            in UTF-8, or holds a control character.
    """
    return _check(field, value, MAX_ID_BYTES, optional)


def check_key(field: str, value: object, *, optional: bool = True) -> str | None:
    """Like :func:`check_id`, with the longer :data:`MAX_KEY_BYTES` limit of keys."""
    return _check(field, value, MAX_KEY_BYTES, optional)


def user_label(user_id: str | None) -> str:
    """A user as a message names them: ``user 'alice'``, or ``the anonymous user`` for the runs
    without a user id (``None``), which "user None" would misname as a user called None."""
    return "the anonymous user" if user_id is None else f"user {id_literal(user_id)}"


_MOST = 2**63 - 1  # what a database's 64-bit LIMIT or OFFSET takes


def check_count(name: str, value: int | None, least: int) -> int | None:
    """``value`` if it is ``None`` or an int from ``least`` up, else a typed error naming it.

    Each backend read a bad one its own way: ``retention=0`` deleted the snapshot just
    written (SQLite, memory), ``-1`` every one (or PostgreSQL refused it as a database
    failure), ``limit=-1`` listed all on SQLite and all but the oldest in memory.
    """
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentTypeError(f"{name} must be an int or None, not {value!r}")
    if not least <= value <= _MOST:
        raise InvalidArgumentError(f"{name} must be an int from {least} to 2**63-1, not {value}")
    return value
