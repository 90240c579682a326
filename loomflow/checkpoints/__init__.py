"""Checkpoints: snapshots of a run's transcript that ``agent.resume()`` restores directly.

With ``Tuning(checkpoint=True)`` the agent writes a :class:`Checkpoint` (messages, usage and
turn) at the end of every pass of its loop, per (session, user). Resuming restores the newest
one instead of re-walking the journal; ``from_checkpoint=`` forks an older one into a new
session. One protocol, :class:`CheckpointStore`, with in-memory, SQLite and PostgreSQL
backends; the SQL ones share the runtime's connection (see :func:`checkpoint_store_for`).
"""

from __future__ import annotations

from ._factory import checkpoint_store_for, checkpoint_store_from_url
from ._protocol import CheckpointStore
from ._sql import PostgresCheckpointStore, SqlCheckpointStore, SqliteCheckpointStore
from ._types import Checkpoint, CheckpointRestored, CheckpointSaved, UnreadableCheckpoint
from .inmemory import InMemoryCheckpointStore

__all__ = [
    "Checkpoint",
    "CheckpointRestored",
    "CheckpointSaved",
    "CheckpointStore",
    "InMemoryCheckpointStore",
    "PostgresCheckpointStore",
    "SqlCheckpointStore",
    "SqliteCheckpointStore",
    "UnreadableCheckpoint",
    "checkpoint_store_for",
    "checkpoint_store_from_url",
]
