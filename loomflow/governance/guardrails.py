"""Guardrails: scan the prompt (and the history given with it), the final answer and live tool
results, then block or redact.

A guardrail finds spans of text (:meth:`Guardrail.find`). With ``action="block"`` a finding
ends the run with ``guardrail:<name>``; with ``action="redact"`` each span is replaced by
``[REDACTED:<kind>]`` and the run goes on. Either way a :class:`GuardrailTripped` event reports
what kinds were found and how many, never the text itself.

Tool results are checked live, before they are journaled, so the journal only ever holds the
redacted value and a replay returns it without scanning again.

Built-ins: :class:`RegexGuardrail` (your patterns) and :class:`PIIGuardrail` (e-mail addresses,
card numbers that pass the Luhn check, and the shapes of common API keys and private keys).
"""

from __future__ import annotations

import abc
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, get_args

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from .._json import unfenced
from .._pii import find_cards, find_emails, luhn_valid
from ..errors import UserError
from ..hooks import Interrupt, RunHooks, RunInfo
from ..messages import Message, ToolCall
from ..redaction import distinct_key
from ..tools import ToolOutcome
from .events import GuardrailTripped

__all__ = [
    "ALL_STAGES",
    "Action",
    "Finding",
    "Guardrail",
    "GuardrailHooks",
    "PIIGuardrail",
    "PII_KINDS",
    "RegexGuardrail",
    "Stage",
    "luhn_valid",
]

Stage: TypeAlias = Literal["input", "output", "tool_result"]
Action: TypeAlias = Literal["block", "redact"]

ALL_STAGES: frozenset[Stage] = frozenset(get_args(Stage))
"""Every stage a guardrail can watch."""

# Names go into interruption reasons and metric-free audit payloads: keep them plain.
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Finding:
    """A span of text a guardrail objects to; ``kind`` names what it is (``email``, ...)."""

    kind: str
    start: int
    end: int


class Guardrail(abc.ABC):
    """Base of guardrails: subclass and implement :meth:`find`.

    Args:
        name: Short name used in ``guardrail:<name>`` and events.
        action: ``block`` (interrupt the run) or ``redact`` (replace the spans).
        stages: Which of ``input`` (the prompt and any history given with it), ``output``
            and ``tool_result`` to watch.
    """

    def __init__(
        self, name: str, *, action: Action = "block", stages: Iterable[Stage] = ALL_STAGES
    ) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise UserError(f"guardrail name {name!r}: use 1-64 letters, digits, '_.:-'")
        if action not in ("block", "redact"):
            raise UserError(f"guardrail action must be 'block' or 'redact', not {action!r}")
        if isinstance(stages, str):
            raise UserError(f"stages must be a collection, e.g. stages=({stages!r},)")
        chosen = frozenset(stages)
        unknown = chosen - ALL_STAGES
        if unknown or not chosen:
            raise UserError(f"guardrail stages must be some of {sorted(ALL_STAGES)}, not {stages}")
        self.name = name
        self.action: Action = action
        self.stages: frozenset[Stage] = chosen

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, action={self.action!r})"

    @abc.abstractmethod
    def find(self, text: str) -> list[Finding]:
        """Every span of ``text`` this guardrail objects to."""

    def redact(self, text: str, findings: Iterable[Finding] | None = None) -> str:
        """``text`` with each finding replaced by ``[REDACTED:<kind>]`` (overlaps merged)."""
        spans = sorted(self.find(text) if findings is None else findings, key=lambda f: f.start)
        merged: list[tuple[int, int, str]] = []
        for finding in spans:
            if merged and finding.start < merged[-1][1]:
                start, end, kind = merged[-1]
                merged[-1] = (start, max(end, finding.end), kind)
            else:
                merged.append((finding.start, finding.end, finding.kind))
        out: list[str] = []
        position = 0
        for start, end, kind in merged:
            out += [text[position:start], f"[REDACTED:{kind}]"]
            position = end
        out.append(text[position:])
        return "".join(out)

    def as_hooks(self) -> GuardrailHooks:
        """The hooks an :class:`~loomflow.agent.Agent` calls (``Agent(guardrails=[...])``)."""
        return GuardrailHooks(self)


class RegexGuardrail(Guardrail):
    """Finds matches of regular expressions.

    Args:
        name: The guardrail's name.
        patterns: One pattern, several, or a mapping of kind to pattern (the kind names the
            finding in events and redactions; it defaults to the guardrail's name).
        flags: ``re`` flags for string patterns.
        action, stages: As for :class:`Guardrail`.

    Example:
        >>> RegexGuardrail("project_names", r"\\bproject-(?:falcon|osprey)\\b",
        ...                action="redact").redact("see project-falcon")
        'see [REDACTED:project_names]'
    """

    def __init__(
        self,
        name: str,
        patterns: str | re.Pattern[str] | Iterable[str | re.Pattern[str]] | Mapping[str, Any],
        *,
        action: Action = "block",
        stages: Iterable[Stage] = ALL_STAGES,
        flags: int = 0,
    ) -> None:
        super().__init__(name, action=action, stages=stages)
        if isinstance(patterns, str | re.Pattern):
            items: list[tuple[str, Any]] = [(name, patterns)]
        elif isinstance(patterns, Mapping):
            items = list(patterns.items())
        else:
            items = [(name, p) for p in patterns]
        if not items:
            raise UserError(f"guardrail {name!r} needs at least one pattern")
        self.patterns: list[tuple[str, re.Pattern[str]]] = []
        for kind, pattern in items:
            try:
                compiled = (
                    pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, flags)
                )
            except (re.error, TypeError) as exc:
                raise UserError(f"guardrail {name!r}: bad pattern {pattern!r}: {exc}") from exc
            self.patterns.append((str(kind), compiled))

    def find(self, text: str) -> list[Finding]:
        return [
            Finding(kind, m.start(), m.end())
            for kind, pattern in self.patterns
            for m in pattern.finditer(text)
            if m.end() > m.start()
        ]


_API_KEYS = re.compile(
    "|".join(
        (
            r"\bsk-ant-[A-Za-z0-9_-]{20,}",  # Anthropic
            r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}",  # OpenAI
            r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",  # AWS access key id
            r"\bgh[pousr]_[A-Za-z0-9]{36,}\b",  # GitHub tokens
            r"\bgithub_pat_[A-Za-z0-9_]{22,}",  # GitHub fine-grained tokens
            r"\bxox[abposr]-[A-Za-z0-9-]{10,}",  # Slack
            r"\bAIza[0-9A-Za-z_-]{35}",  # Google API keys
            r"\b[rs]k_live_[A-Za-z0-9]{16,}",  # Stripe secret and restricted keys
            r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----",  # PEM private keys
        )
    )
)


PII_KINDS: Mapping[str, Callable[[str], list[Finding]]] = {
    # The same shapes the audit log's redactor removes (loomflow._pii).
    "email": lambda text: [Finding("email", *span) for span in find_emails(text)],
    "card": lambda text: [Finding("card", *span) for span in find_cards(text)],
    "api_key": lambda text: [
        Finding("api_key", m.start(), m.end()) for m in _API_KEYS.finditer(text)
    ],
}
"""The detectors :class:`PIIGuardrail` knows, by kind."""


class PIIGuardrail(Guardrail):
    """Finds e-mail addresses, card numbers (Luhn-checked) and API-key shapes.

    Args:
        name: The guardrail's name (``pii``).
        kinds: Which of ``email``, ``card`` and ``api_key`` to look for.
        action: ``redact`` (the default) or ``block``.
        stages: As for :class:`Guardrail`.

    Example:
        >>> PIIGuardrail().redact("mail bob@example.com, card 4111 1111 1111 1111")
        'mail [REDACTED:email], card [REDACTED:card]'
    """

    def __init__(
        self,
        name: str = "pii",
        *,
        kinds: Iterable[str] = tuple(PII_KINDS),
        action: Action = "redact",
        stages: Iterable[Stage] = ALL_STAGES,
    ) -> None:
        super().__init__(name, action=action, stages=stages)
        if isinstance(kinds, str):
            raise UserError(f"kinds must be a collection, e.g. kinds=({kinds!r},)")
        self.kinds = tuple(dict.fromkeys(kinds))
        unknown = [k for k in self.kinds if k not in PII_KINDS]
        if unknown or not self.kinds:
            raise UserError(f"unknown PII kinds {unknown}; use some of {sorted(PII_KINDS)}")

    def find(self, text: str) -> list[Finding]:
        return [finding for kind in self.kinds for finding in PII_KINDS[kind](text)]


def _summary(findings: Iterable[Finding]) -> str:
    counts = Counter(f.kind for f in findings)
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


class GuardrailHooks(RunHooks):
    """Plugs one :class:`Guardrail` into the agent loop."""

    def __init__(self, guardrail: Guardrail) -> None:
        self.guardrail = guardrail

    def _trip(self, info: RunInfo, stage: Stage, findings: list[Finding]) -> None:
        guardrail = self.guardrail
        detail = _summary(findings)
        info.emit(
            GuardrailTripped(
                name=guardrail.name, stage=stage, action=guardrail.action, detail=detail
            )
        )
        if guardrail.action == "block":
            raise Interrupt(f"guardrail:{guardrail.name}", f"{stage} held {detail}")

    def _text(self, info: RunInfo, stage: Stage, text: str) -> str:
        if stage not in self.guardrail.stages:
            return text
        findings = self.guardrail.find(text)
        if not findings:
            return text
        self._trip(info, stage, findings)
        redacted = self.guardrail.redact(text, findings)
        return _still_json(text, redacted, self.guardrail) if stage == "output" else redacted

    async def check_input(self, info: RunInfo, prompt: str) -> str:
        return self._text(info, "input", prompt)

    async def check_history(self, info: RunInfo, messages: list[Message]) -> list[Message]:
        # The input stage covers the history given with the prompt: every message's text and
        # the arguments of its tool calls, whatever its role. One trip for all of them.
        if "input" not in self.guardrail.stages:
            return messages
        findings: list[Finding] = []

        def scan(text: str) -> str:
            found = self.guardrail.find(text)
            findings.extend(found)
            return self.guardrail.redact(text, found) if found else text

        checked: list[Message] = []
        for message in messages:
            before = len(findings)
            content = scan(message.content)
            calls = [
                call.model_copy(update={"arguments": _map_text(call.arguments, scan)})
                for call in message.tool_calls
            ]
            if len(findings) > before:
                message = message.model_copy(update={"content": content, "tool_calls": calls})
            checked.append(message)
        if findings:
            self._trip(info, "input", findings)
        return checked

    async def check_output(self, info: RunInfo, text: str) -> str:
        return self._text(info, "output", text)

    async def check_tool_result(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, outcome: ToolOutcome
    ) -> ToolOutcome:
        if "tool_result" not in self.guardrail.stages:
            return outcome
        findings: list[Finding] = []

        def scan(text: str) -> str:
            found = self.guardrail.find(text)
            findings.extend(found)
            return self.guardrail.redact(text, found) if found else text

        value = _map_text(outcome.value, scan)
        error = scan(outcome.error) if outcome.error is not None else None
        if not findings:
            return outcome
        self._trip(info, "tool_result", findings)
        return outcome.model_copy(update={"value": value, "error": error})


def _still_json(text: str, redacted: str, guardrail: Guardrail) -> str:
    """A JSON answer (a structured output) redacted so that it is still JSON.

    Redacting the text puts ``[REDACTED:card]`` where a card number stood as a JSON number,
    and the answer no longer parses: a redacting guardrail must not fail the run. Such an
    answer is redacted value by value instead (:func:`_map_text`), and written out again.
    """
    try:
        json.loads(unfenced(redacted))
        return redacted
    except (ValueError, RecursionError):
        pass
    try:
        value = json.loads(unfenced(text))  # a fenced answer is taken as JSON, see _output
    except (ValueError, RecursionError):
        return redacted  # not JSON to begin with
    again = json.dumps(_map_text(value, guardrail.redact), ensure_ascii=False)
    # A pattern that spans JSON syntax (r'"ssn": \d+') matches no single value: then the
    # text's redaction stands, JSON or not, rather than an answer that still holds it.
    return redacted if guardrail.find(again) else again


def _map_text(value: Any, fn: Callable[[str], str]) -> Any:
    """Apply ``fn`` to every string (and number, as text) inside a JSON-like value.

    Dict keys count too, and so does any other value (a dataclass, a set, bytes) in the JSON
    form the model is shown: a result keyed by e-mail address, or a dataclass holding one,
    must not reach the model and the journal unscanned.
    """
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        # A card number may come back as a JSON number.
        text = str(value)
        mapped = fn(text)
        return value if mapped == text else mapped
    if isinstance(value, BaseModel):
        return _map_text(value.model_dump(mode="json"), fn)
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            out[distinct_key(_map_key(key, fn), out)] = _map_text(item, fn)
        return out
    if isinstance(value, list | tuple):
        return [_map_text(item, fn) for item in value]
    try:
        plain = to_jsonable_python(value, fallback=str)
    except (ValueError, TypeError):  # bytes that are not UTF-8, say: shown by their repr
        plain = str(value)
    mapped = _map_text(plain, fn)
    return value if mapped == plain else mapped


def _map_key(key: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(key, str):
        return fn(key)
    text = str(key)  # a number or another hashable key reaches JSON as its text
    mapped = fn(text)
    return key if mapped == text else mapped
