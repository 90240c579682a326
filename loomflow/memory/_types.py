"""The three kinds of memory: episodes, facts and working blocks."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from .._ids import check_id, check_key
from .._printable import shown
from ..errors import CorruptEntryError, InvalidIdError, MemoryEntryTooLargeError
from ..messages import Message
from ..runtime import codec
from ..runtime._store import Scope

__all__ = ["Block", "Episode", "Fact", "UnreadableBlock", "UnreadableEpisode", "UnreadableFact"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Episode(_Frozen):
    """The turns of one run of a session: what the next run on the session is reminded of.

    Attributes:
        id: The episode's ULID.
        session_id: The session the run belonged to.
        user_id: Whose conversation it is (``None`` is the anonymous bucket).
        key: The idempotency key: one episode per key, however often it is written.
        run_id: The run that (last) wrote it.
        epoch: The journal epoch of that run, or ``None`` when it ran without a journal.
        messages: The run's own messages: its prompt, the model's turns and tool results.
        output: The run's final answer.
        created_at: When it was first written (store clock, UTC).
    """

    id: str
    session_id: str
    user_id: str | None
    key: str
    run_id: str | None
    epoch: int | None = Field(ge=0)  # a row read back with a negative one is damage
    messages: list[Message]
    output: str
    created_at: dt.datetime


class Fact(_Frozen):
    """A (subject, predicate, object) statement about a user's world, valid for a time.

    A newer fact on the same (subject, predicate) supersedes the current one: the old fact's
    ``valid_to`` becomes the new one's ``valid_from``, and both stay queryable by time.

    Attributes:
        id: The fact's ULID.
        user_id: Whose memory holds it.
        subject: What it is about, e.g. ``"alice"``.
        predicate: The relation, e.g. ``"lives_in"``.
        object: The value, e.g. ``"Paris"``.
        valid_from: When it became true in memory (UTC).
        valid_to: When a newer fact (or a retraction) ended it; ``None`` while current.
        superseded_by: The id of the fact that replaced it, if one did.
        source: Free text naming where it came from (a run id, say).
    """

    id: str
    user_id: str | None
    subject: str
    predicate: str
    object: str
    valid_from: dt.datetime
    valid_to: dt.datetime | None = None
    superseded_by: str | None = None
    source: str | None = None

    @property
    def current(self) -> bool:
        """Whether nothing has superseded or retracted it yet."""
        return self.valid_to is None


class Block(_Frozen):
    """A named piece of working memory a user's agents read and rewrite (notes, a profile).

    Attributes:
        user_id: Whose memory holds it.
        name: The block's name, unique per user.
        content: Its text.
        created_at: When it was first written (UTC).
        updated_at: When it was last written (UTC).
    """

    user_id: str | None
    name: str
    content: str
    created_at: dt.datetime
    updated_at: dt.datetime


class UnreadableEpisode(_Frozen):
    """A stored episode that cannot be read back, as a user's export shows it.

    A row edited by hand or damaged (messages that do not decode, text in a number column, a
    time no date can hold) is no :class:`Episode`; a user's export carries on past it and
    shows it with what its row still tells, as it does an unreadable checkpoint.

    Attributes:
        id: The row's episode id (its ``repr`` when the row does not hold text there).
        session_id: The row's session, as far as it reads.
        user_id: The row's user, as far as it reads.
        key: The row's idempotency key, as far as it reads.
        run_id: The run that wrote it, as far as it reads.
        unreadable: Why it cannot be read back (the ``CorruptEntryError`` message).
    """

    id: str
    session_id: str | None
    user_id: str | None
    key: str | None
    run_id: str | None
    unreadable: str


class UnreadableFact(_Frozen):
    """A stored fact that cannot be read back, as a user's export shows it (see
    :class:`UnreadableEpisode`)."""

    id: str
    user_id: str | None
    subject: str | None
    predicate: str | None
    unreadable: str


class UnreadableBlock(_Frozen):
    """A stored block that cannot be read back, as a user's export shows it (see
    :class:`UnreadableEpisode`)."""

    user_id: str | None
    name: str
    unreadable: str


def checked_name(what: str, value: str) -> str:
    """A subject, predicate or block name as every store takes it: one with a lone surrogate
    (no character: UTF-8 cannot spell it) is an :class:`InvalidIdError` naming ``what``, as an
    id with one is. Made U+FFFD, "a\\udce9" and "a\\udcff" were one name, and one fact or
    block overwrote and read back as the other; on SQLite it was a UnicodeEncodeError, on
    PostgreSQL a store "unavailable"."""
    if not isinstance(value, str):  # a store called directly, past Memory's checks
        raise InvalidIdError(what, f"must be a string, not {type(value).__name__}")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidIdError(what, "holds a lone surrogate, which has no UTF-8 form") from None
    return value


def user_scope(user_id: str | None) -> Scope:
    """The user's scope, the id checked as every store checks it (see :mod:`loomflow._ids`)."""
    return Scope.checked(None, user_id)


def checked_session(session_id: str) -> str:
    """A session id to look episodes up by, checked as every store checks it."""
    return check_id("session_id", session_id, optional=False) or ""


def episode_scope(episode: Episode) -> Scope:
    """The scope an episode is stored under, after its ids and key are checked as a
    :class:`~loomflow.memory.Memory` checks them: an episode handed to a store directly
    with a lone surrogate in one failed differently on each backend."""
    check_id("id", episode.id, optional=False)
    check_key("key", episode.key, optional=False)
    check_id("run_id", episode.run_id)
    return Scope.checked(episode.session_id, episode.user_id)


def timestamp(seconds: float) -> dt.datetime:
    """A store's Unix seconds as an aware UTC datetime."""
    return dt.datetime.fromtimestamp(float(seconds), dt.UTC)


TICK = 1e-6
"""The shortest validity of a fact version: one microsecond, a datetime's resolution."""


def micros(value: float) -> float:
    """Round Unix seconds to the microsecond, the precision a ``datetime`` carries.

    Fact boundaries are stored rounded, so that a ``valid_from`` read back as a datetime and
    passed to ``as_of=`` compares equal to the stored number instead of a hair below it.
    """
    return round(float(value), 6)


def seconds(when: dt.datetime | float) -> float:
    """Unix seconds of a datetime (naive ones are taken as UTC) or of a number."""
    if isinstance(when, dt.datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        return when.timestamp()
    return float(when)


def encode_messages(messages: list[Message]) -> bytes:
    """The stored form of an episode's messages: the journal's tagged JSON."""
    return codec.dumps(list(messages))


def decode_messages(raw: bytes, version: int, episode_id: str) -> list[Message]:
    """Read stored messages back; damaged data is a :class:`CorruptEntryError`."""
    if version > codec.CODEC_VERSION:
        raise CorruptEntryError(f"episode {episode_id} was written by a newer codec (v{version})")
    try:
        value = codec.loads(raw, version=version)
    except codec.UnknownTagError as exc:
        raise CorruptEntryError(f"episode {episode_id} cannot be decoded: {exc}") from exc
    if not isinstance(value, list) or not all(isinstance(m, Message) for m in value):
        raise CorruptEntryError(f"episode {episode_id} does not hold messages")
    return value


_T = TypeVar("_T")


def newest_within(
    newest_first: Sequence[_T],
    measure: Callable[[_T], tuple[object, int]],
    max_bytes: int,
    session_id: str,
    on_too_large: Callable[[CorruptEntryError], None] | None,
) -> list[_T]:
    """The newest episodes whose messages add up to at most ``max_bytes``, newest first
    (``measure`` tells an episode's id and the bytes of its stored messages).

    The walk stops at the first episode that no longer fits, so what is recalled is always
    the end of the conversation, without holes. An episode over ``max_bytes`` on its own is a
    :class:`MemoryEntryTooLargeError` naming it: raised, or, with ``on_too_large``, handed to
    that and skipped, so that one huge row does not cost the session its whole memory.
    """
    kept: list[_T] = []
    left = max_bytes
    for item in newest_first:
        eid, n = measure(item)
        if n > max_bytes:
            error = MemoryEntryTooLargeError(
                f"episode {shown(eid)} of session {shown(session_id)} holds {n} bytes of "
                f"messages, over the {max_bytes}-byte recall cap (history_bytes)"
            )
            if on_too_large is None:
                raise error
            on_too_large(error)
            continue
        if n > left:
            break
        left -= n
        kept.append(item)
    return kept
