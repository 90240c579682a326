"""Memory in process memory: for tests, demos and agents that need nothing durable."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ._types import (
    TICK,
    Block,
    Episode,
    Fact,
    checked_name,
    checked_session,
    episode_scope,
    micros,
    timestamp,
    user_scope,
)

__all__ = ["InMemoryMemoryStore"]


@dataclass(slots=True)
class _User:
    """Everything one user owns: deleting this object forgets them."""

    episodes: list[Episode] = field(default_factory=list)  # in recording order
    # Where each episode key and each session's episodes sit in ``episodes``: a run recalls
    # and records its session's episodes without scanning every session of the user.
    at_key: dict[str, int] = field(default_factory=dict)
    by_session: dict[str, list[int]] = field(default_factory=dict)
    facts: list[Fact] = field(default_factory=list)  # in recording order
    blocks: dict[str, Block] = field(default_factory=dict)

    def index(self) -> None:
        """Rebuild both indexes (after episodes were removed)."""
        self.at_key = {e.key: i for i, e in enumerate(self.episodes)}
        self.by_session = {}
        for i, e in enumerate(self.episodes):
            self.by_session.setdefault(e.session_id, []).append(i)


class InMemoryMemoryStore:
    """A :class:`~loomflow.memory.MemoryStore` over dicts, one partition per user."""

    backend = "memory"

    def __init__(self) -> None:
        self._users: dict[str, _User] = {}

    def __repr__(self) -> str:
        return "InMemoryMemoryStore()"

    def _user(self, user_id: str | None) -> _User:
        """The user's partition, created: only for writes."""
        return self._users.setdefault(user_scope(user_id).user_key, _User())

    def _found(self, user_id: str | None) -> _User:
        """The user's partition, or an empty one left out of ``_users``: a read for an id
        that stored nothing (hostile, or one of many) must not grow the process."""
        found = self._users.get(user_scope(user_id).user_key)
        return found if found is not None else _User()

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def migrate(self) -> int:
        return 0

    # -- episodes ----------------------------------------------------------------------------

    async def put_episode(self, episode: Episode) -> Episode:
        episode_scope(episode)  # refused here as on the SQL stores
        user = self._user(episode.user_id)
        i = user.at_key.get(episode.key)
        if i is not None:
            # As the SQL stores' upsert: the first recording's id, session and time stay.
            old = user.episodes[i]
            user.episodes[i] = episode.model_copy(
                update={"id": old.id, "session_id": old.session_id, "created_at": old.created_at}
            )
            return user.episodes[i]
        stored = episode.model_copy(update={"created_at": timestamp(time.time())})
        user.at_key[stored.key] = len(user.episodes)
        user.by_session.setdefault(stored.session_id, []).append(len(user.episodes))
        user.episodes.append(stored)
        return stored

    async def episodes(
        self,
        session_id: str,
        user_id: str | None,
        *,
        before_epoch: int | None,
        limit: int | None,
    ) -> list[Episode]:
        user = self._found(user_id)
        checked_session(session_id)
        found = [
            e
            for e in (user.episodes[i] for i in user.by_session.get(session_id, ()))
            if before_epoch is None or (e.epoch is not None and e.epoch < before_epoch)
        ]
        # Journal order first; the sort is stable, so recording order breaks ties (and a
        # replaced episode keeps its place).
        found.sort(key=lambda e: e.epoch if e.epoch is not None else -1)
        if limit is not None:
            found = found[len(found) - limit :] if limit > 0 else []
        return found

    async def delete_episodes(self, session_id: str, user_id: str | None) -> int:
        user = self._found(user_id)
        checked_session(session_id)
        kept = [e for e in user.episodes if e.session_id != session_id]
        deleted = len(user.episodes) - len(kept)
        if deleted:
            user.episodes = kept
            user.index()
        return deleted

    # -- facts -------------------------------------------------------------------------------

    async def remember(
        self,
        fact_id: str,
        user_id: str | None,
        subject: str,
        predicate: str,
        object: str,
        source: str | None,
    ) -> Fact:
        subject, predicate = checked_name("subject", subject), checked_name("predicate", predicate)
        user = self._user(user_id)
        now = micros(time.time())
        for i, fact in enumerate(user.facts):
            if fact.subject == subject and fact.predicate == predicate and fact.current:
                if fact.object == object:
                    return fact
                # Every version lasts at least one tick, whatever the clock did.
                start = micros(max(now, fact.valid_from.timestamp() + TICK))
                user.facts[i] = fact.model_copy(
                    update={"valid_to": timestamp(start), "superseded_by": fact_id}
                )
                break
        else:
            start = now
        new = Fact(
            id=fact_id,
            user_id=user_id,
            subject=subject,
            predicate=predicate,
            object=object,
            valid_from=timestamp(start),
            source=source,
        )
        user.facts.append(new)
        return new

    async def retract(self, user_id: str | None, subject: str, predicate: str) -> Fact | None:
        subject, predicate = checked_name("subject", subject), checked_name("predicate", predicate)
        user = self._found(user_id)
        for i, fact in enumerate(user.facts):
            if fact.subject == subject and fact.predicate == predicate and fact.current:
                end = micros(max(time.time(), fact.valid_from.timestamp() + TICK))
                user.facts[i] = fact.model_copy(update={"valid_to": timestamp(end)})
                return user.facts[i]
        return None

    async def facts(
        self,
        user_id: str | None,
        *,
        subject: str | None,
        predicate: str | None,
        as_of: float | None,
        history: bool,
    ) -> list[Fact]:
        subject = None if subject is None else checked_name("subject", subject)
        predicate = None if predicate is None else checked_name("predicate", predicate)
        found = []
        for fact in self._found(user_id).facts:
            if (subject is not None and fact.subject != subject) or (
                predicate is not None and fact.predicate != predicate
            ):
                continue
            if not history:
                if as_of is None:
                    if not fact.current:
                        continue
                elif not (
                    fact.valid_from.timestamp() <= as_of
                    and (fact.valid_to is None or fact.valid_to.timestamp() > as_of)
                ):
                    continue
            found.append(fact)
        return found

    # -- blocks ------------------------------------------------------------------------------

    async def set_block(self, user_id: str | None, name: str, content: str) -> Block:
        name = checked_name("name", name)
        blocks = self._user(user_id).blocks
        now = timestamp(time.time())
        old = blocks.get(name)
        blocks[name] = Block(
            user_id=user_id,
            name=name,
            content=content,
            created_at=old.created_at if old is not None else now,
            updated_at=now,
        )
        return blocks[name]

    async def get_block(self, user_id: str | None, name: str) -> Block | None:
        name = checked_name("name", name)
        return self._found(user_id).blocks.get(name)

    async def blocks(self, user_id: str | None) -> list[Block]:
        return sorted(self._found(user_id).blocks.values(), key=lambda b: b.name)

    async def delete_block(self, user_id: str | None, name: str) -> bool:
        name = checked_name("name", name)
        return self._found(user_id).blocks.pop(name, None) is not None

    # -- per user ----------------------------------------------------------------------------

    async def forget_user(self, user_id: str | None) -> dict[str, int]:
        user = self._users.pop(user_scope(user_id).user_key, _User())
        return {
            "episodes": len(user.episodes),
            "facts": len(user.facts),
            "blocks": len(user.blocks),
        }

    async def export_user(
        self, user_id: str | None
    ) -> tuple[list[Episode], list[Fact], list[Block]]:
        user = self._found(user_id)
        return (
            list(user.episodes),
            list(user.facts),
            sorted(user.blocks.values(), key=lambda b: b.name),
        )
