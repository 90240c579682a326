"""Keeping sensitive tool arguments out of the journal (and of checkpoints and transcripts).

The journal stores each model response so that a resumed run replays it, and a response holds
the tool calls the model asked for, arguments included. A :class:`Sealer` rewrites the response
*before* it is journaled: each argument a tool declares ``sensitive`` (and each argument
holding a secret shape or a configured secret, each one whose name the redactor hides, such
as ``db_password``, and each one holding such a name at any depth, as in ``config={"password":
...}``) becomes a placeholder ``[sealed:<hmac>]``, and
the real value stays in process memory only, in the sealer of the run. Everything downstream
(the journal, the tool step's key, the transcript the model sees next, checkpoints, events)
carries the placeholder; only the tool invocation gets the real value back
(:meth:`Sealer.unseal`).

Replays need no real value: a replayed tool call returns its journaled result. The one case
that would is a worker that died after journaling the model call but before journaling the
tool result: the resumed run then has the placeholder and no value, and :meth:`Sealer.unseal`
raises :class:`SealedValueLost`, which the loop answers to the model as a tool error asking it
to call the tool again (it still knows the value from the conversation it was given).

The loop also passes tool results through :meth:`Sealer.scrub` before journaling them, so a
tool that echoes a sealed value does not leak it either.

Results are sealed the same way when the tool says ``sensitive_result=True``: the successful
value of each live call becomes one ``[sealed-result:<hmac>]`` placeholder before it is
journaled (:meth:`Sealer.seal_result`), so the tool step's journal entry, the transcript the
run keeps (and so checkpoints, memory episodes, ``RunResult.messages``), events and audit
entries hold the placeholder. Only the request to the model is rebuilt with the real text
(:meth:`Sealer.unseal_messages`). The real texts stay in the memory of the process, shared by
the runs of one agent, so a run resumed by the same agent in the same process still gives the
model the value. Replayed model calls need no real value (the journal answers them, and their
fingerprint is taken over the sealed transcript, so it matches). A live model call in another
process (a resume after a crash), whose transcript holds a result sealed by the dead one, gets
:data:`SEALED_RESULT_LOST` instead: the value is gone, and the tool can be called again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import re
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel

from .._json import canonical_json, json_safe
from .._sealed import SEALED_ARGUMENT
from ..messages import Message, ModelResponse, ToolCall, ToolCallDelta
from ..redaction import _MIN_SECRET, PLACEHOLDER, Redactor
from ..runtime import codec
from ..tools import Tool, ToolOutcome

__all__ = ["SEALED_ERROR", "SEALED_RESULT_LOST", "SealedArguments", "SealedValueLost", "Sealer"]

SEALED_ERROR = "sealed_arguments_lost"
"""``ToolOutcome.error_type`` of a call whose sealed arguments are gone after a restart."""

SEALED_RESULT_LOST = (
    "[sealed result: its value was kept only in the memory of the process that called the "
    "tool, which is gone; call the tool again if you need it]"
)
"""What the model reads for a result sealed in another process (before a restart, say)."""

_PLACEHOLDER = SEALED_ARGUMENT
_RESULT_PLACEHOLDER = re.compile(r"^\[sealed-result:[0-9a-f]{20}\]$")


def _holds_nothing(value: Any) -> bool:
    return value is None or value == "" or isinstance(value, bool)


def _named_secrets(redactor: Redactor, value: Any) -> list[Any]:
    """The values under keys that :meth:`Redactor.seals_key` seals, at any depth of
    ``value`` (mappings, lists, sets, and the fields of models and dataclasses, which the
    journal prints by name as it prints a dict's keys), leaving out those that hold nothing."""
    found: list[Any] = []
    pending = [value] if _walked(value) else []  # a loop: arguments may nest deep
    seen: set[int] = set()  # a dataclass that holds itself passes json_safe (its repr)
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Mapping):
            pairs: Iterable[tuple[Any, Any]] = item.items()
        elif isinstance(item, BaseModel):
            pairs = ((k, getattr(item, k, None)) for k in type(item).model_fields)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            pairs = ((f.name, getattr(item, f.name, None)) for f in dataclasses.fields(item))
        else:  # a list, tuple or set
            pending.extend(i for i in item if _walked(i))
            continue
        for key, inner in pairs:
            if isinstance(key, str) and redactor.seals_key(key):
                if not _holds_nothing(inner):
                    found.append(inner)
            elif _walked(inner):
                pending.append(inner)
    return found


_LEAVES = frozenset({str, int, float, bool, type(None)})


def _walked(value: Any) -> bool:
    """Whether :func:`_named_secrets` looks inside ``value`` (strings and numbers it skips)."""
    t = type(value)
    if t in _LEAVES:  # most of what a model sends: answered without the checks below
        return False
    if t is dict or t is list:
        return True
    if isinstance(value, Mapping | list | tuple | set | frozenset | BaseModel):
        return True
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


class SealedValueLost(LookupError):
    """A sealed argument's value is not in this process (the run resumed after a crash)."""


class SealedArguments(OrderedDict[str, Any]):
    """Sealed argument values (placeholder to value) of one agent's runs, in this process.

    Shared by the runs of one agent, like sealed results, so that a run resumed in the same
    process (an approval endpoint resuming the run that waited, say) still hands the tool its
    real arguments. The oldest values are forgotten past ``max_size``; a run that needs one
    then gets :class:`SealedValueLost`, as after a restart.
    """

    def __init__(self, max_size: int = 4096) -> None:
        super().__init__()
        self.key = os.urandom(32)  # placeholders need only be unique within this process
        self.max_size = max_size

    def __setitem__(self, placeholder: str, value: Any) -> None:
        super().__setitem__(placeholder, value)
        self.move_to_end(placeholder)
        while len(self) > self.max_size:
            self.popitem(last=False)


class Sealer:
    """Seals sensitive tool-call arguments of one run's model responses.

    Args:
        tools: The agent's tools by name (their ``sensitive`` argument names are sealed, and
            the results of those declaring ``sensitive_result``).
        redactor: Also seal arguments holding a secret it recognises, and teach it the sealed
            values so that logs scrub them too.
        results: Where sealed results are kept (placeholder to text), shared by the runs of
            one agent so that a run resumed in the same process still reads them; the
            oldest are forgotten past ``max_results``.
        max_results: How many sealed results ``results`` keeps.
    """

    def __init__(
        self,
        tools: Mapping[str, Tool[..., Any]],
        redactor: Redactor | None = None,
        *,
        results: OrderedDict[str, str] | None = None,
        max_results: int = 1024,
        arguments: SealedArguments | None = None,
    ):
        self._tools = tools
        self._redactor = redactor
        # Sealed argument values, and the key of their placeholders, shared by the runs of one
        # agent (see SealedArguments): a run resumed in this process still has the values.
        shared = arguments if arguments is not None else SealedArguments()
        self._key = shared.key
        self._vault = shared
        # Result placeholder -> the text the model reads.
        self._results: OrderedDict[str, str] = results if results is not None else OrderedDict()
        self._max_results = max_results

    def _placeholder(self, tool: str, name: str, value: Any) -> str:
        digest = hmac.new(self._key, codec.canonical_bytes([tool, name, value]), hashlib.sha256)
        return f"[sealed:{digest.hexdigest()[:20]}]"

    def _sensitive(self, tool_name: str, name: str, value: Any) -> tuple[bool, Any]:
        """Whether the argument ``name`` is sealed, and what of it the redactor learns."""
        found = self._tools.get(tool_name)
        if found is not None and name in found.sensitive:
            return True, value
        redactor = self._redactor
        if redactor is None:
            return False, None
        # An argument named as a secret (db_password, apiToken) is sealed as the audit log
        # hides it (a doubtful name such as boarding_pass only hidden there); one that holds
        # nothing (None, a flag, "") has nothing to keep out and is left for a resumed run.
        if redactor.seals_key(name) and not _holds_nothing(value):
            return True, value
        if redactor.contains_secret(canonical_json(json_safe(value))):
            return True, value
        # A secret named inside the value (config={"password": ...}) seals all of it: the
        # tool gets the value whole. Only the secrets are learned, not the host beside them,
        # which would vanish from every text the model reads.
        nested = _named_secrets(redactor, value)
        return bool(nested), nested

    def seal_call(self, call: ToolCall) -> ToolCall:
        """``call`` with its sensitive arguments replaced by placeholders."""
        sealed: dict[str, Any] = {}
        for name, value in call.arguments.items():
            if isinstance(value, str) and _PLACEHOLDER.match(value):
                continue  # already sealed (a replayed response)
            sensitive, secret = self._sensitive(call.name, name, value)
            if sensitive:
                placeholder = self._placeholder(call.name, name, value)
                self._vault[placeholder] = value
                sealed[name] = placeholder
                if self._redactor is not None:
                    self._redactor.learn(secret)
        if not sealed:
            return call
        return call.model_copy(update={"arguments": {**call.arguments, **sealed}})

    def seal_response(self, response: ModelResponse) -> ModelResponse:
        """``response`` with the arguments of its tool calls sealed."""
        calls = [self.seal_call(c) for c in response.tool_calls]
        if all(a is b for a, b in zip(calls, response.tool_calls, strict=True)):
            return response
        return response.model_copy(update={"tool_calls": calls})

    async def stream(self, chunks: AsyncIterable[Any]) -> AsyncGenerator[Any, None]:
        """Pass a model stream through, sealed.

        Text streams as it comes. Tool-call deltas are held until the final response: a call
        with nothing to seal is then replayed delta for delta, a sealed one as a single delta
        carrying its sealed arguments; deltas of no call of the response (or of a stream that
        brought none) are not shown. Use it with ``contextlib.aclosing`` so an abandoned
        stream closes the model's stream at once.
        """
        source = aiter(chunks)
        # One generator, not one wrapped in another: every chunk of every turn passes here.
        held: dict[int, list[ToolCallDelta]] = {}
        try:
            async for chunk in source:
                if isinstance(chunk, ToolCallDelta):
                    held.setdefault(chunk.index, []).append(chunk)
                    continue
                if isinstance(chunk, ModelResponse):
                    sealed = self.seal_response(chunk)
                    for index in sorted(held):
                        if index >= len(chunk.tool_calls):
                            # Deltas that name no call of the response (a model that numbers
                            # its calls its own way) cannot be checked for secrets: not shown.
                            continue
                        original, now = chunk.tool_calls[index], sealed.tool_calls[index]
                        if now is original:
                            for delta in held[index]:
                                yield delta
                        else:
                            yield ToolCallDelta(
                                index=index,
                                id=now.id,
                                name=now.name,
                                arguments_delta=canonical_json(now.arguments),
                            )
                    held.clear()
                    yield sealed
                    continue
                yield chunk
            # A stream that ended without a response: its held deltas belong to no call that
            # can be checked for secrets, and none of them runs, so they are not shown either.
        finally:
            # Close the model's stream now, in this context, not whenever it is collected:
            # an abandoned stream must release what it holds (spans, connections) at once.
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    def unseal(self, call: ToolCall) -> ToolCall:
        """``call`` with the real values back, for the tool invocation only.

        Raises:
            SealedValueLost: a placeholder's value is not known to this process.
        """
        restored: dict[str, Any] = {}
        for name, value in call.arguments.items():
            if isinstance(value, str) and _PLACEHOLDER.match(value):
                if value not in self._vault:
                    raise SealedValueLost(
                        f"the argument {name!r} of this {call.name!r} call was sealed, and its "
                        "value did not survive the restart of the run; call the tool again "
                        "with the same arguments"
                    )
                restored[name] = self._vault[value]
        if not restored:
            return call
        return call.model_copy(update={"arguments": {**call.arguments, **restored}})

    def seal_result(self, tool_name: str, outcome: ToolOutcome) -> ToolOutcome:
        """``outcome`` with its value sealed, if the tool declares ``sensitive_result``.

        Only a successful value is sealed; an error's text goes through :meth:`scrub` like
        any other tool's.
        """
        found = self._tools.get(tool_name)
        if found is None or not found.sensitive_result or not outcome.ok:
            return outcome
        if isinstance(outcome.value, str) and _RESULT_PLACEHOLDER.match(outcome.value):
            return outcome  # already sealed
        text = outcome.as_text()
        digest = hmac.new(self._key, codec.canonical_bytes([tool_name, text]), hashlib.sha256)
        placeholder = f"[sealed-result:{digest.hexdigest()[:20]}]"
        # Not taught to the redactor, unlike sealed arguments: a result's leaves include
        # ordinary words ("active", a city) that must not vanish from every other text.
        self._results[placeholder] = text
        while len(self._results) > self._max_results:
            self._results.popitem(last=False)
        return outcome.model_copy(update={"value": placeholder})

    def unseal_messages(self, messages: list[Message]) -> list[Message]:
        """``messages`` as the model must read them: sealed results replaced by their text.

        A result sealed by another process (the run resumed after a crash) becomes
        :data:`SEALED_RESULT_LOST`. The list given is not changed.
        """
        out: list[Message] = []
        for message in messages:
            if message.role == "tool" and _RESULT_PLACEHOLDER.match(message.content):
                text = self._results.get(message.content)
                if text is None:
                    text = SEALED_RESULT_LOST
                else:
                    self._results.move_to_end(message.content)
                message = message.model_copy(update={"content": text})
            out.append(message)
        return out

    def _short_values_hidden(self, call: ToolCall, text: str) -> str:
        """``text`` without the values of ``call``'s sensitive arguments that are too short for
        the redactor to learn (a three-digit CVV would vanish from every text): a tool's error
        that echoes its own is all that hides them from the journal and the audit log. Only
        where they stand alone, not inside a longer number or word."""
        found = self._tools.get(call.name)
        if found is None:
            return text
        for name in found.sensitive:
            value = call.arguments.get(name)
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                continue
            shown = str(value)
            if shown and len(shown) < _MIN_SECRET and shown in text:
                alone = rf"(?<![0-9A-Za-z]){re.escape(shown)}(?![0-9A-Za-z])"
                text = re.sub(alone, PLACEHOLDER, text)
        return text

    def lost(self, error: SealedValueLost) -> ToolOutcome:
        """The tool error the model gets for a call whose sealed values are gone."""
        return ToolOutcome(ok=False, error_type=SEALED_ERROR, error=str(error))

    def scrub(self, outcome: ToolOutcome, call: ToolCall | None = None) -> ToolOutcome:
        """``outcome`` without sealed values or secrets in its value or error text; ``call``
        is the call as it ran (real values), whose short sensitive values its error may echo."""
        update: dict[str, Any] = {}
        if outcome.error is not None:
            error = (
                outcome.error if call is None else self._short_values_hidden(call, outcome.error)
            )
            if self._redactor is not None:
                # Secrets only: personal data a tool returns is for the model to read (tools
                # mark such results sensitive_result=True to keep them out of the journal).
                error = self._redactor.text(error, pii=False)
            if error != outcome.error:
                update["error"] = error
        if self._redactor is None:
            return outcome.model_copy(update=update) if update else outcome
        if outcome.ok and outcome.value is not None:
            plain = json_safe(outcome.value)
            clean = self._redactor._plain_value(plain, pii=False)  # plain already: not again
            if clean != plain:  # only a result that held a secret changes shape
                update["value"] = clean
        return outcome.model_copy(update=update) if update else outcome
