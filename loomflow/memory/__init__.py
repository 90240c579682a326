"""Per-user memory: episodes of sessions, facts with a history, and working blocks.

Give an agent a :class:`Memory` (``Agent(memory=...)``) and each run on a session is reminded
of the earlier runs of the same (session, user); the run's own turns are recorded as an
episode by a journaled, idempotent step. Every read and write is partitioned by user id.
Backends: :class:`InMemoryMemory`, :class:`SqliteMemory`, :class:`PostgresMemory`, and
:func:`memory_for` to store memory beside a runtime's journal on its connection.
"""

from __future__ import annotations

from ._factory import memory_for, memory_from_url
from ._memory import InMemoryMemory, Memory, PostgresMemory, SqliteMemory
from ._protocol import AgentMemory, MemoryStore
from ._sql import SqlMemoryStore
from ._types import Block, Episode, Fact, UnreadableBlock, UnreadableEpisode, UnreadableFact
from .inmemory import InMemoryMemoryStore

__all__ = [
    "AgentMemory",
    "Block",
    "Episode",
    "Fact",
    "InMemoryMemory",
    "InMemoryMemoryStore",
    "Memory",
    "MemoryStore",
    "PostgresMemory",
    "SqlMemoryStore",
    "SqliteMemory",
    "UnreadableBlock",
    "UnreadableEpisode",
    "UnreadableFact",
    "memory_for",
    "memory_from_url",
]
