"""The checkpoint store protocol: one seam, three sibling backends."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ._types import Checkpoint

__all__ = ["CheckpointStore"]


@runtime_checkable
class CheckpointStore(Protocol):
    """Where transcript snapshots live, partitioned by (session, user).

    Every read names the session *and* the user: a checkpoint of one user is invisible to
    another, even on the same session id. ``user_id=None`` is a bucket of its own.
    """

    backend: str

    async def open(self) -> None:
        """Connect (and migrate, unless disabled); later calls do it on first use anyway."""

    async def close(self) -> None:
        """Release the connection this store opened (a shared one stays open)."""

    async def migrate(self) -> int:
        """Apply pending schema migrations; return the version now in place."""

    async def put(self, checkpoint: Checkpoint, *, retention: int | None = None) -> Checkpoint:
        """Store a snapshot; then keep only the newest ``retention`` of its (session, user).

        Returns the checkpoint with ``created_at`` filled in by the store's clock. An id
        that is already stored, in any session of any user, is an ``InvalidIdError``.
        """

    async def latest(self, session_id: str, *, user_id: str | None) -> Checkpoint | None:
        """The newest snapshot of (session, user), if any."""

    async def get(
        self, checkpoint_id: str, *, session_id: str, user_id: str | None
    ) -> Checkpoint | None:
        """One snapshot by id, only if it belongs to (session, user)."""

    async def list_checkpoints(
        self, session_id: str, *, user_id: str | None, limit: int | None = None
    ) -> list[Checkpoint]:
        """The snapshots of (session, user), newest first."""

    async def delete_session(self, session_id: str, *, user_id: str | None) -> int:
        """Delete every snapshot of (session, user); return how many went."""

    async def forget_user(self, user_id: str | None) -> int:
        """Delete every snapshot of a user, across sessions; return how many went."""

    async def export_user(self, user_id: str | None) -> dict[str, Any]:
        """Every snapshot of a user as JSON-ready data, oldest first."""
