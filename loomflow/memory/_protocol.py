"""The memory storage protocol: what :class:`~loomflow.memory.Memory` needs from a backend.

Every operation takes the user it acts for; no operation reads or writes across users except
:meth:`MemoryStore.forget_user` and :meth:`MemoryStore.export_user`, which act on exactly one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ._types import Block, Episode, Fact, UnreadableBlock, UnreadableEpisode, UnreadableFact

if TYPE_CHECKING:
    from ..messages import Message

__all__ = ["AgentMemory", "MemoryStore"]


@runtime_checkable
class AgentMemory(Protocol):
    """What an agent run needs of a memory (:class:`~loomflow.memory.Memory` is one).

    A run recalls the earlier episodes of its (session, user) before its first model call,
    and records its own turns as one episode when it returns.
    """

    async def history(
        self, session_id: str, *, user_id: str | None, before_epoch: int | None = None
    ) -> list[Message]:
        """The messages of the session's earlier episodes (journal epoch below
        ``before_epoch``), oldest first."""
        ...

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
    ) -> Episode:
        """Store one run's turns; the same ``key`` again replaces that episode, never adds."""
        ...


@runtime_checkable
class MemoryStore(Protocol):
    """Episodes, facts and blocks, partitioned by user; implemented once per backend."""

    backend: str

    async def open(self) -> None:
        """Connect (and migrate, unless disabled)."""

    async def close(self) -> None:
        """Release the connection this store opened (a shared one stays open)."""

    async def migrate(self) -> int:
        """Apply pending schema migrations; return the version now in place."""

    async def put_episode(self, episode: Episode) -> Episode:
        """Insert, or replace the episode with the same (user, key); return what is stored.

        A replaced episode keeps its id and ``created_at``.
        """

    async def episodes(
        self,
        session_id: str,
        user_id: str | None,
        *,
        before_epoch: int | None,
        limit: int | None,
    ) -> list[Episode]:
        """The newest ``limit`` episodes of (session, user), oldest first.

        With ``before_epoch``, only episodes of runs at a lower journal epoch.
        """

    async def delete_episodes(self, session_id: str, user_id: str | None) -> int: ...

    async def remember(
        self,
        fact_id: str,
        user_id: str | None,
        subject: str,
        predicate: str,
        object: str,
        source: str | None,
    ) -> Fact:
        """Make (subject, predicate, object) the user's current fact, atomically.

        The current fact on (subject, predicate), if any, is closed at the new one's start.
        Re-asserting the current object changes nothing and returns the current fact.
        """

    async def retract(self, user_id: str | None, subject: str, predicate: str) -> Fact | None:
        """Close the current fact on (subject, predicate); return it as closed."""

    async def facts(
        self,
        user_id: str | None,
        *,
        subject: str | None,
        predicate: str | None,
        as_of: float | None,
        history: bool,
    ) -> list[Fact]:
        """Facts in the order they were recorded.

        ``history=True``: every version. Otherwise those valid at ``as_of`` (Unix seconds),
        or the current ones when ``as_of`` is ``None``.
        """

    async def set_block(self, user_id: str | None, name: str, content: str) -> Block: ...

    async def get_block(self, user_id: str | None, name: str) -> Block | None: ...

    async def blocks(self, user_id: str | None) -> list[Block]: ...

    async def delete_block(self, user_id: str | None, name: str) -> bool: ...

    async def forget_user(self, user_id: str | None) -> dict[str, int]:
        """Delete everything of one user; return how many episodes, facts and blocks went."""

    async def export_user(
        self, user_id: str | None
    ) -> tuple[
        Sequence[Episode | UnreadableEpisode],
        Sequence[Fact | UnreadableFact],
        Sequence[Block | UnreadableBlock],
    ]:
        """Everything of one user, each kind in the order it was recorded. A row that cannot
        be read back (edited by hand, damaged) is in it as an ``Unreadable*`` saying why,
        so that one damaged row does not fail a user's whole export."""
