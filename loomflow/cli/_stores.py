"""Where the CLI's commands find their stores, and refusing ones that are not there."""

from __future__ import annotations

from pathlib import Path

from ..config import Settings
from ..errors import ConfigurationError, JournalError, UserError
from ..runtime import JournalRuntime, SessionInfo
from ..storage._url import sqlite_path

__all__ = ["existing", "session_of"]


def existing(url: str, what: str) -> str:
    """``url``, if it names a file that exists (or is not a file store at all).

    Commands that only read or tidy a store must not create an empty one at a mistyped path
    and then report that all is well (an ``audit verify`` cron job would pass on a typo).

    Raises:
        ConfigurationError: a SQLite or JSON-lines store whose file does not exist, or a
            ``memory://`` store (it lives inside one process: a command started on its own
            would read an empty one, or write a hold or a cancellation that is gone at exit).
    """
    if url.startswith("memory:"):
        raise ConfigurationError(
            f"a memory:// {what} lives inside the process that made it, so a command cannot "
            "read or change it: point the command at the SQLite file or PostgreSQL database "
            "the application uses"
        )
    if url.startswith("jsonl://"):
        path: str | None = url.removeprefix("jsonl://")[1:]  # as audit_store_from_url reads it
    elif "://" not in url and url.endswith(".jsonl"):
        path = url
    else:
        path = sqlite_path(url)
    if path is not None and path != ":memory:" and not Path(path).exists():
        if url == Settings.model_fields["runtime_url"].default:
            # No --url and no LOOMFLOW_RUNTIME_URL: say how to name the journal a program wrote.
            raise ConfigurationError(
                f"no {what} at {path}, the default journal: name yours with --url "
                "(`loomflow --url sqlite:///journal.db ...`) or with LOOMFLOW_RUNTIME_URL"
            )
        raise ConfigurationError(
            f"no {what} at {path}: check the URL (a new store is made by `loomflow migrate` "
            "or by its first write)"
        )
    return url


async def session_of(
    runtime: JournalRuntime, session_id: str, user_id: str | None, *, anonymous: bool
) -> SessionInfo:
    """The (session, user) a command means: ``--user``, ``--anonymous``, or, with neither,
    the one user who ran that session id.

    Raises:
        JournalError: no such session (for that user).
        UserError: several users ran that session id and none was named.
    """
    if anonymous:
        found = await runtime.sessions(user_id=None, session_id=session_id)
    elif user_id is not None:
        found = await runtime.sessions(user_id=user_id, session_id=session_id)
    else:
        found = await runtime.sessions(session_id=session_id)
    if not found:
        who = " without a user" if anonymous else ""
        if user_id is not None:
            who = f" of user {user_id!r}"
        raise JournalError(f"no session {session_id!r}{who} in the journal")
    if len(found) > 1:
        users = ", ".join(
            sorted("(no user)" if s.user_id is None else repr(s.user_id) for s in found)
        )
        raise UserError(
            f"session {session_id!r} has runs of several users ({users}): "
            "pick one with --user (or --anonymous)"
        )
    return found[0]
