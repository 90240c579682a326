"""The memory an agent is given: one class over any :class:`MemoryStore` backend."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ulid import ULID

from .._ids import check_count, check_id, check_key
from .._json import json_safe, valid_text
from .._timefmt import iso_time
from ..config import Settings
from ..context import get_run_context
from ..errors import CorruptEntryError, InvalidArgumentTypeError, UserError
from ..messages import Message
from ..redaction import Redactor
from ..runtime._store import Scope
from ..storage import PostgresDatabase, SqliteDatabase
from ..tools import Tool
from ._protocol import MemoryStore
from ._sql import SqlMemoryStore
from ._types import (
    Block,
    Episode,
    Fact,
    checked_name,
    encode_messages,
    newest_within,
    seconds,
)
from .inmemory import InMemoryMemoryStore

if TYPE_CHECKING:
    import asyncpg

__all__ = ["InMemoryMemory", "Memory", "PostgresMemory", "SqliteMemory"]

log = logging.getLogger("loomflow.memory")


DEFAULT_HISTORY_BYTES = 8 * 1024 * 1024
"""The default cap on the stored messages a run recalls (the journal's default step cap)."""

# A subject, predicate or block name is a lookup key: PostgreSQL indexes it (an index entry
# holds at most about 8 KB), so a long one is refused here, alike on every backend.
MAX_KEY_BYTES = 1024


def _text(what: str, value: object, *, quote: bool = True) -> str:
    """A lookup key, checked. ``quote=False`` keeps the value out of the error (a memory
    tool's: a tool error is a span status, exported even with content capture off)."""
    if not isinstance(value, str) or not value:
        shown_value = f", not {value!r}" if quote else ""
        raise UserError(f"{what} must be a non-empty string{shown_value}")
    if "\x00" in value:
        raise UserError(f"{what}{f' {value[:80]!r}' if quote else ''} contains a NUL character")
    size = len(checked_name(what, value).encode())  # a lone surrogate refused, as in an id
    if size > MAX_KEY_BYTES:
        raise UserError(
            f"{what}{f' {value[:40]!r}...' if quote else ''} is {size} bytes in UTF-8; "
            f"at most {MAX_KEY_BYTES}"
        )
    return value


def _key_argument(what: str, value: object) -> str:
    """A memory tool's lookup key: :func:`_text`, with an error that does not quote it."""
    return _text(what, value, quote=False)


def _content(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise UserError(f"{what} must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise UserError(f"{what} contains a NUL character")
    return valid_text(value)


# Every character str.splitlines breaks a line at, written as its escape in what a memory tool
# tells the model: recall_facts shows a fact a line, so a stored value holding one read as
# facts never remembered. Only these: a tab, an accent or a backslash stays as it is.
_ONE_LINE = str.maketrans(
    {c: c.encode("unicode_escape").decode() for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}
)


def _fact_line(subject: str, predicate: str, value: str) -> str:
    """One fact as one line of a memory tool's answer, whatever its parts hold."""
    return f"{subject} {predicate} {value}".translate(_ONE_LINE)


def _argument(check: Callable[[str, object], str], what: str, value: object) -> str:
    """A memory tool's argument, checked as the API checks it. A bad one is the model's
    mistake, told to it as a tool error: as the API's UserError it stopped the run, and every
    resume of it, since the replayed model call asks for the same call again. The error names
    the argument, not its value: the model knows what it sent, and the error is also a span's
    status, exported with content capture off (see :func:`_key_argument`)."""
    try:
        return check(what, value)
    except UserError as exc:
        raise ValueError(str(exc)) from None


@contextlib.contextmanager
def _damage_told(tool: str) -> Iterator[None]:
    """A damaged fact or block met by a memory tool, told to the model as a tool error.

    As a damaged episode is left out of a run's recall: raised, it stopped the run and every
    resume of it (the replayed model call asks for the same call again).
    The model is told only that the entry is damaged; the details (which may name the user a
    moved row belongs to) go to the log.
    """
    try:
        yield
    except CorruptEntryError:
        log.warning("memory tool %r met a damaged entry; the model is told", tool, exc_info=True)
        raise ValueError(
            "the stored memory entry is damaged and cannot be read; it can be overwritten"
        ) from None


def _source(value: object) -> str | None:
    """A fact's ``source``: free text or ``None``. Checked before the write, so that a
    number or a NUL is refused by name on every backend, not stored (SQLite) or turned
    into a driver error (PostgreSQL)."""
    return None if value is None else _content("source", value)


def _when(value: object) -> float:
    """``as_of``: a datetime or Unix seconds (a finite number), else a ``UserError``."""
    if isinstance(value, dt.datetime):
        return seconds(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            if math.isfinite(value):  # an int past a float's range raises OverflowError
                return seconds(value)
        except OverflowError:
            # Not shown: formatting such an int may itself fail (past 4,300 digits).
            raise UserError(
                f"as_of is an integer of {int(value).bit_length()} bits: out of range for Unix "
                "seconds"
            ) from None
    raise UserError(f"as_of must be a datetime or Unix seconds, not {value!r}")


def _exported(episode: Any) -> Any:
    """An episode (or an unreadable one) as JSON data, for a user's export."""
    try:
        return episode.model_dump(mode="json")
    except ValueError:
        # Bytes no UTF-8 spells in a tool call's arguments (an episode imported through
        # record_episode: the codec stores them) failed the user's whole export.
        document = episode.model_dump(mode="json", exclude={"messages"})
        document["messages"] = json_safe([m.model_dump() for m in episode.messages])
        return document


def _user(user_id: object) -> str | None:
    return Scope.checked(None, user_id).user_id


def _session(session_id: object) -> str:
    return check_id("session_id", session_id, optional=False) or ""


def _key(key: object) -> str:
    return check_key("key", key, optional=False) or ""


class Memory:
    """Per-user memory: episodes of sessions, facts with a history, and working blocks.

    Every read and write names the user it is for (``user_id=None`` is the anonymous
    bucket, a partition of its own); nothing crosses from one user to another.

    Given to an agent (``Agent(memory=...)``), it reminds each outermost run of the earlier
    runs of the same (session, user) and records the run's own turns as an episode when the
    run returns; see the memory docs for how that stays exact under replay.

    Args:
        store: The backend (:class:`InMemoryMemoryStore`, :class:`SqlMemoryStore`, or yours).
        history_episodes: How many of the latest episodes a run is reminded of (``None``:
            all of them).
        history_bytes: The most bytes of stored messages a run is reminded of (default 8 MiB,
            the journal's default step cap; ``None``: no cap). The newest episodes that fit
            are recalled; one over the cap on its own is left out with a warning.
        redactor: What takes secrets out of a fact's object and source and a block's text
            before they are stored, as out of an episode (default: the one the settings
            describe, ``LOOMFLOW_REDACT_*``; an agent's default memory uses the agent's).
    """

    def __init__(
        self,
        store: MemoryStore,
        *,
        history_episodes: int | None = 20,
        history_bytes: int | None = DEFAULT_HISTORY_BYTES,
        redactor: Redactor | None = None,
    ) -> None:
        self.store = store
        self.history_episodes = check_count("history_episodes", history_episodes, 0)
        self.history_bytes = check_count("history_bytes", history_bytes, 1)
        if redactor is not None and not isinstance(redactor, Redactor):
            raise InvalidArgumentTypeError(
                f"redactor must be a loomflow.redaction.Redactor, not {type(redactor).__name__}"
            )
        self.redactor = redactor if redactor is not None else Redactor.from_settings()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r})"

    @property
    def backend(self) -> str:
        """``"memory"``, ``"sqlite"`` or ``"postgres"``."""
        return self.store.backend

    async def open(self) -> None:
        """Connect (and migrate) now rather than on first use."""
        await self.store.open()

    async def close(self) -> None:
        """Close the connection this memory opened (a runtime's shared one stays open)."""
        await self.store.close()

    async def migrate(self) -> int:
        """Apply pending schema migrations; return the version now in place."""
        return await self.store.migrate()

    async def __aenter__(self) -> Memory:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- episodes ----------------------------------------------------------------------------

    async def record_episode(
        self,
        session_id: str,
        *,
        user_id: str | None,
        key: str,
        messages: list[Message],
        output: str,
        run_id: str | None = None,
        epoch: int | None = None,
        token: int | None = None,
    ) -> Episode:
        """Store the turns of one run; writing the same ``key`` again replaces, never adds.

        The agent calls this from a journaled step (see the memory docs); call it yourself to
        import conversations. ``token`` fences the write on the run's lease (a SQL store on
        the journal's database only, see :meth:`SqlMemoryStore.put_episode`); agents pass it
        through :meth:`~loomflow.runtime.JournalRuntime.record_episode`.
        """
        # Checked by name before the write, alike on every backend: a flag was taken as epoch
        # 1, an epoch past 64 bits was a "store unavailable" failure on the SQL backends.
        if not isinstance(messages, list | tuple) or not all(
            isinstance(m, Message) for m in messages
        ):
            raise InvalidArgumentTypeError("messages must be a list of Message")
        episode = Episode(
            id=str(ULID()),
            session_id=_session(session_id),
            user_id=_user(user_id),
            key=_key(key),
            run_id=check_id("run_id", run_id),
            epoch=check_count("epoch", epoch, 0),
            messages=list(messages),
            output=_content("output", output),
            created_at=dt.datetime.now(dt.UTC),  # replaced by the store's clock
        )
        if token is None:
            return await self.store.put_episode(episode)
        return await self.store.put_episode(episode, token=token)  # type: ignore[call-arg]

    async def episodes(
        self,
        session_id: str,
        *,
        user_id: str | None,
        before_epoch: int | None = None,
        limit: int | None = None,
        on_damaged: Callable[[CorruptEntryError], None] | None = None,
        max_bytes: int | None = None,
    ) -> list[Episode]:
        """The episodes of (session, user), oldest first; the newest ``limit`` of them.

        ``before_epoch`` keeps only runs journaled at a lower epoch than that one. An episode
        that cannot be read back is a ``CorruptEntryError``; with ``on_damaged``, it is
        handed to that instead and left out (on a store of your own, which cannot leave one
        out, the whole session is). ``max_bytes`` keeps the newest episodes whose stored
        messages add up to at most that many bytes; one over it on its own is a
        ``MemoryEntryTooLargeError`` naming it (handed to ``on_damaged`` when given).
        """
        # Checked here, alike on every backend: a string was a TypeError, a float or a flag
        # taken as a number, and a number past 64 bits a "store unavailable" failure.
        check_count("limit", limit, 0)
        check_count("max_bytes", max_bytes, 1)
        check_count("before_epoch", before_epoch, 0)
        session, user = _session(session_id), _user(user_id)
        if before_epoch is not None and before_epoch <= 0:
            # No run journals below epoch 0: the first run of a session (the common case)
            # recalls nothing, so it need not ask the store.
            return []
        if isinstance(self.store, SqlMemoryStore):
            # The cap applied in the query: an oversize row's messages are never loaded.
            return await self.store.episodes(
                session,
                user,
                before_epoch=before_epoch,
                limit=limit,
                on_damaged=on_damaged,
                max_bytes=max_bytes,
            )
        try:
            found = await self.store.episodes(session, user, before_epoch=before_epoch, limit=limit)
        except CorruptEntryError as exc:
            if on_damaged is None:
                raise
            on_damaged(exc)
            return []
        if max_bytes is None:
            return found
        # Another store hands the episodes over decoded: each is measured by its encoding,
        # one codec pass per recalled episode.
        kept = newest_within(
            found[::-1],
            lambda e: (e.id, len(encode_messages(e.messages))),
            max_bytes,
            session,
            on_damaged,
        )
        return kept[::-1]

    async def history(
        self,
        session_id: str,
        *,
        user_id: str | None,
        before_epoch: int | None = None,
        on_damaged: Callable[[CorruptEntryError], None] | None = None,
    ) -> list[Message]:
        """The messages a run on (session, user) is reminded of, oldest first.

        The latest ``history_episodes`` episodes (of runs before ``before_epoch``) that fit
        in ``history_bytes``, flattened; ``on_damaged`` as for :meth:`episodes`.
        """
        episodes = await self.episodes(
            session_id,
            user_id=user_id,
            before_epoch=before_epoch,
            limit=self.history_episodes,
            on_damaged=on_damaged,
            max_bytes=self.history_bytes,
        )
        return [message for episode in episodes for message in episode.messages]

    async def forget_session(self, session_id: str, *, user_id: str | None) -> int:
        """Delete the episodes of one (session, user); return how many went."""
        return await self.store.delete_episodes(_session(session_id), _user(user_id))

    # -- facts -------------------------------------------------------------------------------

    async def remember(
        self,
        subject: str,
        predicate: str,
        object: str,
        *,
        user_id: str | None,
        source: str | None = None,
    ) -> Fact:
        """Record that ``subject`` ``predicate`` ``object`` holds from now on, for this user.

        It supersedes the user's current fact on the same (subject, predicate); repeating the
        current object changes nothing. Example: ``remember("alice", "lives_in", "Paris",
        user_id="alice")``. Secrets in ``object`` and ``source`` are redacted before storing.
        """
        source = _source(source)
        return await self.store.remember(
            str(ULID()),
            _user(user_id),
            _text("subject", subject),
            _text("predicate", predicate),
            self.redactor.text(_content("object", object)),
            None if source is None else self.redactor.text(source),
        )

    async def retract(self, subject: str, predicate: str, *, user_id: str | None) -> Fact | None:
        """End the current fact on (subject, predicate) without a successor."""
        return await self.store.retract(
            _user(user_id), _text("subject", subject), _text("predicate", predicate)
        )

    async def facts(
        self,
        *,
        user_id: str | None,
        subject: str | None = None,
        predicate: str | None = None,
        as_of: dt.datetime | float | None = None,
        history: bool = False,
    ) -> list[Fact]:
        """The user's facts, in the order they were recorded.

        By default the current ones; with ``as_of`` (a datetime or Unix seconds) those that
        were valid then; with ``history=True`` every version, superseded ones included.
        """
        if not isinstance(history, bool):  # "no" was taken as True
            raise InvalidArgumentTypeError(f"history must be True or False, not {history!r}")
        if history and as_of is not None:
            raise UserError("pass as_of or history=True, not both")
        return await self.store.facts(
            _user(user_id),
            subject=None if subject is None else _text("subject", subject),
            predicate=None if predicate is None else _text("predicate", predicate),
            as_of=None if as_of is None else _when(as_of),
            history=history,
        )

    # -- working blocks ----------------------------------------------------------------------

    async def set_block(self, name: str, content: str, *, user_id: str | None) -> Block:
        """Create or overwrite the user's block ``name`` (secrets in ``content`` redacted)."""
        content = self.redactor.text(_content("content", content))
        return await self.store.set_block(_user(user_id), _text("name", name), content)

    async def block(self, name: str, *, user_id: str | None) -> Block | None:
        """The user's block ``name``, if it exists."""
        return await self.store.get_block(_user(user_id), _text("name", name))

    async def blocks(self, *, user_id: str | None) -> list[Block]:
        """Every block of the user, by name."""
        return await self.store.blocks(_user(user_id))

    async def delete_block(self, name: str, *, user_id: str | None) -> bool:
        """Delete the user's block ``name``; ``False`` if there was none."""
        return await self.store.delete_block(_user(user_id), _text("name", name))

    # -- per user ----------------------------------------------------------------------------

    async def forget_user(self, user_id: str | None) -> dict[str, int]:
        """Delete every episode, fact and block of one user (a right-to-erasure request).

        Returns how many of each went, e.g. ``{"episodes": 3, "facts": 5, "blocks": 1}``.
        """
        return await self.store.forget_user(_user(user_id))

    async def export_user(self, user_id: str | None) -> dict[str, Any]:
        """Everything memory holds about one user, as JSON-ready data.

        ``{"user_id", "exported_at", "episodes", "facts", "blocks"}``, each list in recording
        order; ``json.dumps`` takes it as is. A row that cannot be read back is in it as what
        its row still tells, with an ``unreadable`` reason, as a checkpoint's export shows one.
        """
        uid = _user(user_id)
        episodes, facts, blocks = await self.store.export_user(uid)
        return {
            "user_id": uid,
            "exported_at": iso_time(dt.datetime.now(dt.UTC)),
            "episodes": [_exported(e) for e in episodes],
            "facts": [f.model_dump(mode="json") for f in facts],
            "blocks": [b.model_dump(mode="json") for b in blocks],
        }

    # -- tools for the model -----------------------------------------------------------------

    def tools(self) -> list[Tool[..., Any]]:
        """Tools that let the model use this memory for the user of the run calling them.

        ``remember_fact``, ``recall_facts``, ``read_block`` and ``write_block``. The user
        comes from the run context, never from the model. They are ordinary tool calls, so
        the journal replays them instead of writing twice.
        """

        async def remember_fact(subject: str, predicate: str, value: str) -> str:
            """Remember a fact about the user's world; it replaces the previous value.

            Args:
                subject: What the fact is about, e.g. "user" or "project".
                predicate: The relation, e.g. "prefers_language".
                value: The value, e.g. "French".
            """
            subject = _argument(_key_argument, "subject", subject)
            predicate = _argument(_key_argument, "predicate", predicate)
            value = _argument(_content, "value", value)
            ctx = get_run_context()
            with _damage_told("remember_fact"):
                await self.remember(
                    subject, predicate, value, user_id=ctx.user_id, source=ctx.run_id
                )
            return f"remembered: {_fact_line(subject, predicate, value)}"

        async def recall_facts(subject: str | None = None) -> str:
            """List what is remembered about the user's world.

            Args:
                subject: Only facts about this subject.
            """
            if subject is not None:
                subject = _argument(_key_argument, "subject", subject)
            with _damage_told("recall_facts"):
                facts = await self.facts(user_id=get_run_context().user_id, subject=subject)
            if not facts:
                return "nothing remembered"
            return "\n".join(_fact_line(f.subject, f.predicate, f.object) for f in facts)

        async def read_block(name: str) -> str:
            """Read one of the user's working-memory blocks.

            Args:
                name: The block's name, e.g. "notes".
            """
            name = _argument(_key_argument, "name", name)
            with _damage_told("read_block"):
                found = await self.block(name, user_id=get_run_context().user_id)
            return found.content if found is not None else f"(no block named {name!r})"

        async def write_block(name: str, content: str) -> str:
            """Overwrite one of the user's working-memory blocks.

            Args:
                name: The block's name, e.g. "notes".
                content: Its new text.
            """
            name = _argument(_key_argument, "name", name)
            content = _argument(_content, "content", content)
            with _damage_told("write_block"):
                await self.set_block(name, content, user_id=get_run_context().user_id)
            return f"block {name!r} saved"

        return [
            Tool(remember_fact, edits=True),
            Tool(recall_facts),
            Tool(read_block),
            Tool(write_block, edits=True),
        ]


def redactor_of(settings: Settings | None) -> Redactor | None:
    """The redactor ``settings`` describe; ``None`` (the environment's) without settings."""
    return None if settings is None else Redactor.from_settings(settings)


class InMemoryMemory(Memory):
    """Memory that lives as long as this object (tests, demos)."""

    def __init__(
        self,
        *,
        history_episodes: int | None = 20,
        history_bytes: int | None = DEFAULT_HISTORY_BYTES,
        redactor: Redactor | None = None,
    ) -> None:
        super().__init__(
            InMemoryMemoryStore(),
            history_episodes=history_episodes,
            history_bytes=history_bytes,
            redactor=redactor,
        )


class SqliteMemory(Memory):
    """Memory in a SQLite file: a path (owned) or a runtime's ``SqliteDatabase`` (shared).

    Example:
        >>> memory = SqliteMemory(runtime.database)  # on the journal's connection
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | SqliteDatabase,
        *,
        history_episodes: int | None = 20,
        history_bytes: int | None = DEFAULT_HISTORY_BYTES,
        redactor: Redactor | None = None,
        auto_migrate: bool | None = None,
        settings: Settings | None = None,
    ) -> None:
        if isinstance(target, SqliteDatabase):
            store = SqlMemoryStore(target, auto_migrate=auto_migrate, settings=settings)
        else:
            s = settings or Settings()
            db = SqliteDatabase.from_settings(target, s)
            store = SqlMemoryStore(db, owns_db=True, auto_migrate=auto_migrate, settings=s)
        super().__init__(
            store,
            history_episodes=history_episodes,
            history_bytes=history_bytes,
            redactor=redactor if redactor is not None else redactor_of(settings),
        )


class PostgresMemory(Memory):
    """Memory in PostgreSQL: a DSN or pool, or a runtime's ``PostgresDatabase`` (shared)."""

    def __init__(
        self,
        target: str | asyncpg.Pool | PostgresDatabase,
        *,
        history_episodes: int | None = 20,
        history_bytes: int | None = DEFAULT_HISTORY_BYTES,
        redactor: Redactor | None = None,
        auto_migrate: bool | None = None,
        settings: Settings | None = None,
    ) -> None:
        if isinstance(target, PostgresDatabase):
            store = SqlMemoryStore(target, auto_migrate=auto_migrate, settings=settings)
        else:
            store = SqlMemoryStore(
                PostgresDatabase(target),  # which closes only a pool it created itself
                owns_db=True,
                auto_migrate=auto_migrate,
                settings=settings,
            )
        super().__init__(
            store,
            history_episodes=history_episodes,
            history_bytes=history_bytes,
            redactor=redactor if redactor is not None else redactor_of(settings),
        )
