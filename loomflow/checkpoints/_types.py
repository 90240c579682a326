"""What a checkpoint holds, and how its transcript is stored."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .._ids import check_count, check_id
from .._printable import is_unicode
from ..errors import CheckpointError, InvalidArgumentError, InvalidIdError, UserError
from ..messages import Message, Usage
from ..runtime import codec

__all__ = ["Checkpoint", "CheckpointRestored", "CheckpointSaved", "UnreadableCheckpoint"]


class Checkpoint(BaseModel):
    """A snapshot of one run's transcript, taken at the end of a pass of the agent loop.

    Attributes:
        id: The checkpoint's ULID.
        session_id: The session of the run.
        user_id: The user of the run (``None`` is the anonymous bucket).
        run_id: The run that wrote it.
        epoch: The journal epoch of that run; a restored run continues in it.
        turn: Model turns completed when the snapshot was taken (the next turn's number).
        final: The model had answered without tool calls: the loop was done.
        prompt: The prompt the run was started with, as the caller passed it.
        output: The last answer text seen so far.
        messages: The whole transcript, system prompt first.
        prompt_index: Position of the run's own prompt in ``messages``; what comes before it
            is the system prompt and the history rehydrated from memory.
        usage: Tokens of every model call up to this point.
        cost_usd: Estimated cost of those calls.
        parent_id: The checkpoint this one was forked from, if any.
        created_at: When the store recorded it (the database clock), UTC.
        output_type: The name of the ``output_type`` the run validated its answer into
            (``None`` for a plain-text run, and when not recorded).
        output_format: The run's output contract: the digest of its output format, which
            keys its model calls, or ``"text"`` without ``output_type``. ``None`` for a
            snapshot written before loomflow recorded it. A resume under another contract
            does not restore the snapshot (the journal's model calls do not replay either).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    session_id: str
    user_id: str | None
    run_id: str
    epoch: int = Field(ge=0)
    turn: int = Field(ge=0)
    final: bool
    prompt: str
    output: str
    messages: list[Message]
    prompt_index: int = Field(ge=0)
    usage: Usage
    cost_usd: float = Field(ge=0.0)
    parent_id: str | None = None
    created_at: dt.datetime | None = None
    output_type: str | None = None
    output_format: str | None = Field(default=None, pattern=r"^(text|[0-9a-f]{64})$")

    def summary(self) -> dict[str, Any]:
        """The checkpoint without its transcript, as JSON-ready data (for listings)."""
        return {
            "id": self.id,
            "session_id": self.session_id,
            "user_id": self.user_id,
            "run_id": self.run_id,
            "epoch": self.epoch,
            "turn": self.turn,
            "final": self.final,
            "messages": len(self.messages),
            "tokens_in": self.usage.input_tokens,
            "tokens_out": self.usage.output_tokens,
            "cost_usd": self.cost_usd,
            "parent_id": self.parent_id,
            "created_at": self.created_at.isoformat() if self.created_at else None,
        }


def check_writable(checkpoint: Checkpoint) -> None:
    """Refuse, by name, what not every backend can keep, before a store writes it.

    Each store read its own way what its columns cannot hold: PostgreSQL failed a NUL in an
    id or in the prompt, a lone surrogate or a number past its column as StoreUnavailableError
    (an outage, to an operator), SQLite a big number too and a lone surrogate as a bare
    UnicodeEncodeError, and memory kept any of them.
    """
    check_id("id", checkpoint.id, optional=False)
    check_id("run_id", checkpoint.run_id, optional=False)
    check_id("parent_id", checkpoint.parent_id)
    for name, text in (("prompt", checkpoint.prompt), ("output", checkpoint.output)):
        if "\x00" in text:
            raise UserError(
                f"checkpoint {name} contains a NUL character, which no backend can store"
            )
        if not is_unicode(text):
            raise UserError(f"checkpoint {name} holds a lone surrogate, which has no UTF-8 form")
    check_count("epoch", checkpoint.epoch, 0)
    check_count("turn", checkpoint.turn, 0)
    check_count("prompt_index", checkpoint.prompt_index, 0)
    if not math.isfinite(checkpoint.cost_usd):
        raise InvalidArgumentError(f"cost_usd must be a finite number, not {checkpoint.cost_usd}")


class UnreadableCheckpoint(BaseModel):
    """A stored checkpoint that cannot be read back, as listings and exports show it.

    A row edited by hand (text in a number column, a transcript that does not decode) is
    no :class:`Checkpoint`; resume skips it and replays the journal. A listing
    (``SqlCheckpointStore.listing``, ``loomflow checkpoints list``) or a user's export shows
    it with what its row still tells, instead of failing as a whole.

    Attributes:
        id: The row's checkpoint id (its ``repr`` when the row does not hold text there).
        session_id: The row's session, as far as it reads.
        user_id: The row's user, as far as it reads.
        run_id: The run that wrote it, as far as it reads.
        unreadable: Why it cannot be read back (the ``CheckpointError`` message).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    session_id: str | None
    user_id: str | None
    run_id: str | None
    unreadable: str

    def summary(self) -> dict[str, Any]:
        """The row as JSON-ready data for listings (what :meth:`Checkpoint.summary` gives)."""
        return self.model_dump(mode="json")


class CheckpointSaved(BaseModel):
    """Agent event: a snapshot of the transcript was stored at the end of a pass."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["checkpoint_saved"] = "checkpoint_saved"
    checkpoint_id: str
    turn: int
    final: bool


class CheckpointRestored(BaseModel):
    """Agent event: the run continues from a snapshot instead of replaying the journal.

    ``forked_from`` names the snapshot's session when it was forked into a new one.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["checkpoint_restored"] = "checkpoint_restored"
    checkpoint_id: str
    turn: int
    forked_from: str | None = None


def taken(checkpoint_id: str) -> InvalidIdError:
    """The error of a put() whose checkpoint id is already stored (in any session)."""
    return InvalidIdError(
        "id", f"{checkpoint_id!r} is already stored: each checkpoint needs an id of its own"
    )


def timestamp(seconds: float) -> dt.datetime:
    """A store's Unix seconds as an aware UTC datetime."""
    return dt.datetime.fromtimestamp(float(seconds), dt.UTC)


def encode_payload(checkpoint: Checkpoint) -> bytes:
    """The stored form of a snapshot's transcript and output contract: the journal's tagged
    JSON, an object so that it can carry more than the transcript without a new column."""
    return codec.dumps(
        {
            "messages": list(checkpoint.messages),
            "output_type": checkpoint.output_type,
            "output_format": checkpoint.output_format,
        }
    )


def decode_payload(raw: bytes, version: int, checkpoint_id: str) -> dict[str, Any]:
    """Read a stored payload back as Checkpoint fields; a damaged one is a
    :class:`CheckpointError`. A bare list of messages is a snapshot written before the
    payload carried the output contract: it reads with the contract unknown."""
    if version > codec.CODEC_VERSION:
        raise CheckpointError(
            f"checkpoint {checkpoint_id} was written by a newer codec (v{version}); "
            "upgrade loomflow"
        )
    try:
        value = codec.loads(raw, version=version)
    except codec.UnknownTagError as exc:
        raise CheckpointError(f"checkpoint {checkpoint_id} cannot be decoded: {exc}") from exc
    # Keys a later release adds are left alone; the ones read here are checked by the model.
    fields = value if isinstance(value, dict) else {"messages": value}
    messages = fields.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, Message) for m in messages):
        raise CheckpointError(f"checkpoint {checkpoint_id} does not hold a transcript")
    return {
        "messages": messages,
        "output_type": fields.get("output_type"),
        "output_format": fields.get("output_format"),
    }
