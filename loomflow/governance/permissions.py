"""Permissions: decide, right before a tool runs live, whether it may run.

:meth:`StandardPermissions.check` answers ``allow``, ``deny`` or ``ask`` with a reason and the
name of the policy that decided. Rules come in layers (everyone's, then per role, then per
user) and every matching rule counts: a ``deny`` anywhere beats an ``ask`` anywhere, which beats
an ``allow``. A mode then sets what happens when no rule speaks:

- ``default``: plain tools run; tools marked ``edits`` or ``destructive`` need approval.
- ``acceptEdits``: as ``default``, but tools marked ``edits`` run without approval (unless they
  are also ``destructive``).
- ``bypass``: nothing needs approval, so ``ask`` rules allow too; ``deny`` rules still deny.
- ``readOnly``: tools marked ``edits`` or ``destructive`` are denied, whatever allows them.

An ``ask`` goes to the approval handler, which may allow, deny, edit the arguments, and remember
its answer for the rest of the run; without a handler the call is denied. With
``approval="defer"`` nobody is asked in the process: the run stops at the call and returns
interrupted, and a decision given later, from any process, continues it
(:mod:`loomflow.governance.approvals`). A denied call never
runs: the model receives a ``permission_denied`` tool error and the run goes on. Because the
check sits inside the journaled tool step, a replayed result is never checked again.
"""

from __future__ import annotations

import asyncio
import fnmatch
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias, get_args

from .._ids import check_id
from .._sealed import holds_sealed_argument
from ..errors import UserError
from ..hooks import RunHooks, RunInfo
from ..messages import ToolCall
from ..redaction import Redactor
from ..tools import Tool, ToolOutcome
from .approvals import deferred_decision, journaled_request, kept_placeholder, shown_arguments
from .events import PermissionDecided

__all__ = [
    "Approval",
    "ApprovalHandler",
    "ApprovalRequest",
    "Behavior",
    "Decision",
    "Mode",
    "PERMISSION_DENIED",
    "PermissionContext",
    "PermissionHooks",
    "Policy",
    "REDACTED",
    "Rule",
    "StandardPermissions",
    "redact_arguments",
]

log = logging.getLogger("loomflow.governance.permissions")

Mode: TypeAlias = Literal["default", "acceptEdits", "bypass", "readOnly"]
Behavior: TypeAlias = Literal["allow", "deny", "ask"]
ArgumentMatcher: TypeAlias = str | Callable[[Any], bool]

PERMISSION_DENIED: Final = "permission_denied"
"""``ToolOutcome.error_type`` of a call the permission layer refused."""
REDACTED: Final = "[REDACTED]"
"""What a sensitive argument's value is replaced with in events."""

_MODES = frozenset(get_args(Mode))
_BEHAVIORS = frozenset(get_args(Behavior))
# When roles disagree on the mode, the strictest wins.
_STRICTNESS = {"bypass": 0, "acceptEdits": 1, "default": 2, "readOnly": 3}


def redact_arguments(arguments: Mapping[str, Any], sensitive: frozenset[str]) -> dict[str, Any]:
    """A copy of ``arguments`` with the values of ``sensitive`` names replaced."""
    return {k: (REDACTED if k in sensitive else v) for k, v in arguments.items()}


@dataclass(frozen=True, slots=True)
class Rule:
    """Allow, deny or ask for tool calls that match.

    Args:
        behavior: ``allow``, ``deny`` or ``ask``.
        tool: A glob on the tool name (``"*"``, ``"fs_*"``, ``"delete_user"``).
        args: Per argument name, a glob on the value's text (a non-string as Python or as JSON
            writes it: ``True`` or ``true``) or a predicate on the value, tried on the value as
            sent and as the tool receives it after validation; every one must match (an
            argument left out is judged as the default the tool runs with; without a default,
            it does not match). A glob on a list or mapping judges its elements (a mapping's
            values, and for deny and ask its keys too): a deny or ask rule matches when any
            one matches, an allow rule only when all do. A predicate gets the whole value.
        when: A predicate on the whole arguments dict (as sent, and as validated).
        destructive: Match only tools with (``True``) or without (``False``) that flag.
        edits: Match only tools with or without the ``edits`` flag.
        reason: Said to the model and the audit log when this rule decides.

    Example:
        >>> Rule.deny("shell", args={"command": "rm *"}, reason="no deletions")  # doctest: +SKIP
    """

    behavior: Behavior
    tool: str = "*"
    args: Mapping[str, ArgumentMatcher] = field(default_factory=dict)
    when: Callable[[Mapping[str, Any]], bool] | None = None
    destructive: bool | None = None
    edits: bool | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.behavior not in _BEHAVIORS:
            raise UserError(f"rule behavior must be allow, deny or ask, not {self.behavior!r}")
        if not isinstance(self.tool, str) or not self.tool:
            raise UserError(f"rule tool must be a non-empty glob, not {self.tool!r}")
        # A rule that can never match (a flag of "true", an argument name of 1) would let
        # through exactly what a deny rule was written to stop: refused here, not at a call.
        if not isinstance(self.args, Mapping):
            raise UserError(
                f"rule {self.tool!r}: args must be a mapping of argument names to globs or "
                f"predicates, not {type(self.args).__name__}"
            )
        for name, matcher in self.args.items():
            if not isinstance(name, str):
                raise UserError(
                    f"rule {self.tool!r}: argument names are strings (as the model sends "
                    f"them), not {name!r}"
                )
            if not isinstance(matcher, str) and not callable(matcher):
                raise UserError(
                    f"rule argument {name!r}: use a glob string or a predicate, not {matcher!r}"
                )
        if self.when is not None and not callable(self.when):
            raise UserError(
                f"rule {self.tool!r}: when must be a predicate on the arguments, not {self.when!r}"
            )
        for flag in ("destructive", "edits"):
            value = getattr(self, flag)
            if value is not None and not isinstance(value, bool):
                raise UserError(
                    f"rule {self.tool!r}: {flag} must be True, False or None, not {value!r}"
                )
        if not isinstance(self.reason, str):
            raise UserError(f"rule {self.tool!r}: reason must be text, not {self.reason!r}")
        object.__setattr__(self, "args", MappingProxyType(dict(self.args)))

    @classmethod
    def allow(cls, tool: str = "*", **options: Any) -> Rule:
        """A rule that allows matching calls."""
        return cls("allow", tool, **options)

    @classmethod
    def deny(cls, tool: str = "*", **options: Any) -> Rule:
        """A rule that denies matching calls."""
        return cls("deny", tool, **options)

    @classmethod
    def ask(cls, tool: str = "*", **options: Any) -> Rule:
        """A rule that sends matching calls to the approval handler."""
        return cls("ask", tool, **options)

    def matches(
        self, call: ToolCall, tool: Tool[..., Any] | None, *, received: Received | None = None
    ) -> bool:
        """Whether this rule applies to ``call`` (predicates may raise; the caller denies).
        ``received`` shares the validated arguments between the rules judging one call."""
        if not fnmatch.fnmatchcase(call.name, self.tool):
            return False
        if self.destructive is not None and bool(tool and tool.destructive) != self.destructive:
            return False
        if self.edits is not None and bool(tool and tool.edits) != self.edits:
            return False
        # What the model sent is judged first; only where that does not match, the values the
        # tool runs with (a "yes" or 1 it reads as True, a 22.0 or " 22" it reads as 22), so
        # that they cannot dodge a rule written for True or 22.
        validated = received if received is not None else Received(tool, call.arguments)
        # A glob on a list (or a mapping) judges its elements: a rule that restricts (deny,
        # ask) matches when any of them matches, one that allows only when all of them do.
        every = self.behavior == "allow"
        for name, matcher in self.args.items():
            if name in call.arguments:
                value = call.arguments[name]
                if isinstance(matcher, str):
                    if _glob_matches(matcher, value, every=every):
                        continue
                elif matcher(value):
                    continue
            # Left out, the argument is judged as the default the tool runs with.
            coerced = validated.value(name)
            if coerced is _ABSENT:
                return False
            if isinstance(matcher, str):
                if not _glob_matches(matcher, coerced, every=every):
                    return False
            elif not _holds(matcher, coerced):
                return False
        if self.when is None or self.when(call.arguments):
            return True
        arguments = validated.arguments()
        return arguments is not None and _holds(self.when, arguments)

    def describe(self) -> str:
        """A short text naming the rule, for reasons."""
        parts = [repr(self.tool)]
        parts += [
            f"{k}={v!r}" if isinstance(v, str) else f"{k}=<predicate>" for k, v in self.args.items()
        ]
        if self.when is not None:
            parts.append("when=<predicate>")
        for flag in ("destructive", "edits"):
            if getattr(self, flag) is not None:
                parts.append(f"{flag}={getattr(self, flag)}")
        return f"{self.behavior}({', '.join(parts)})"


_ABSENT: Any = object()  # an argument the validated call does not hold


class Received:
    """One call's arguments as its tool receives them after validation, worked out at most
    once however many rules ask (and not at all when what the model sent decides)."""

    __slots__ = ("_arguments", "_done", "_tool", "_value")

    def __init__(self, tool: Tool[..., Any] | None, arguments: Mapping[str, Any]) -> None:
        self._tool, self._arguments = tool, arguments
        self._value: dict[str, Any] | None = None
        self._done = False

    def arguments(self) -> dict[str, Any] | None:
        """The validated arguments by name; ``None`` without a tool, or when they do not
        validate (the tool then does not run)."""
        if not self._done:
            self._done = True
            if self._tool is not None:
                self._value = self._tool.received_arguments(self._arguments)
        return self._value

    def value(self, name: str) -> Any:
        """One validated argument, or ``_ABSENT``."""
        arguments = self.arguments()
        return _ABSENT if arguments is None else arguments.get(name, _ABSENT)


def _holds(predicate: Callable[[Any], Any], validated: Any) -> bool:
    """Whether ``predicate`` holds for a validated value. It was written for what the model
    sends and was tried on that first (where raising denies): here, failing is no match."""
    try:
        return bool(predicate(validated))
    except Exception:
        return False


def _glob_matches(pattern: str, value: Any, *, every: bool) -> bool:
    """Whether the glob ``pattern`` matches an argument's value.

    A scalar matches when one of its texts does. A list (tuple, set) or mapping is judged by
    its parts, the elements of a list and the values of a mapping, nested ones the same way:
    with ``every`` (an allow rule) each part must match, so that one allowed path cannot
    carry a forbidden one past the rule; without it (deny, ask) one part is enough, and so is
    a mapping's key or the text of the whole value (``"*etc*"`` on ``["/etc/passwd"]``), so
    that no shape of the value dodges the rule. An empty one has no part: its text decides.
    """
    if isinstance(value, Mapping):
        parts: list[Any] = list(value.values())
        if not every:
            parts += list(value.keys())
    elif isinstance(value, list | tuple | set | frozenset):
        parts = list(value)
    else:
        return any(fnmatch.fnmatchcase(text, pattern) for text in _texts(value))
    if every and parts:
        return all(_glob_matches(pattern, part, every=True) for part in parts)
    if any(fnmatch.fnmatchcase(text, pattern) for text in _texts(value)):
        return True
    return any(_glob_matches(pattern, part, every=False) for part in parts)


def _texts(value: Any) -> tuple[str, ...]:
    """The texts an argument glob is matched against: a string itself; any other value as
    Python writes it (``True``, ``None``) and as the model sent it in JSON (``true``,
    ``null``), so that a deny rule written either way is not dodged by the other."""
    if isinstance(value, str):
        return (value,)
    try:
        sent = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # not from JSON: a hook's or an edit's
        return (str(value),)
    return (str(value), sent)


def _rules(rules: object) -> tuple[Rule, ...]:
    if isinstance(rules, Rule | str | bytes | Mapping) or not isinstance(rules, Iterable):
        raise UserError(
            f"rules must be a list of Rule objects, e.g. [Rule.deny('drop_*')], not {rules!r}"
        )
    return tuple(rules)


@dataclass(frozen=True, slots=True)
class Policy:
    """Rules (and optionally a mode) for one role or one user."""

    rules: Sequence[Rule] = ()
    mode: Mode | None = None

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in _MODES:
            raise UserError(f"unknown permission mode {self.mode!r}; use one of {sorted(_MODES)}")
        object.__setattr__(self, "rules", _rules(self.rules))
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise UserError(f"policy rules must be Rule objects, not {rule!r}")


@dataclass(frozen=True, slots=True)
class Decision:
    """The permission layer's answer for one call.

    Attributes:
        behavior: ``allow``, ``deny`` or ``ask``.
        reason: Why, in words for people and the model.
        policy: Which policy decided: ``global``, ``role:<name>``, ``user:<id>``, or ``error``
            when a rule or the check itself failed (which denies).
        rule: The rule that decided, if a rule did (not the mode).
    """

    behavior: Behavior
    reason: str
    policy: str
    rule: Rule | None = None

    @property
    def allowed(self) -> bool:
        return self.behavior == "allow"


@dataclass(frozen=True, slots=True)
class PermissionContext:
    """What a check knows besides the call: the tool's flags, the caller's roles, the run."""

    tool: Tool[..., Any] | None = None
    roles: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    run_id: str | None = None
    session_id: str | None = None

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, Any],
        *,
        tool: Tool[..., Any] | None = None,
        run_id: str | None = None,
        session_id: str | None = None,
    ) -> PermissionContext:
        """Roles come from ``metadata["role"]``: one name, or a list (or set) of names.

        Raises:
            UserError: ``metadata["role"]`` is something else (an enum member, a number, a
                list holding one): read as no role, it would shed that role's restrictions.
        """
        role = metadata.get("role")
        if role is None:
            roles: tuple[str, ...] = ()
        elif isinstance(role, str):
            roles = (role,)
        elif isinstance(role, list | tuple | set | frozenset) and all(
            isinstance(r, str) for r in role
        ):
            roles = tuple(sorted(role)) if isinstance(role, set | frozenset) else tuple(role)
        else:
            raise UserError(
                f"metadata['role'] must be a role name or a list of role names, not {role!r}"
            )
        return cls(tool, roles, metadata, run_id, session_id)


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """What an approval handler is asked about.

    ``redactor`` is the run's: what it finds is hidden from ``redacted_arguments`` too.
    """

    call: ToolCall
    tool: Tool[..., Any] | None
    user_id: str | None
    decision: Decision
    context: PermissionContext
    redactor: Redactor | None = None

    @property
    def redacted_arguments(self) -> dict[str, Any]:
        """The arguments as a deferred request shows them, for showing to people: the tool's
        sensitive values and what the run's redactor finds (secrets, personal data) hidden."""
        sensitive = self.tool.sensitive if self.tool else frozenset()
        return shown_arguments(self.redactor, redact_arguments(self.call.arguments, sensitive))


@dataclass(frozen=True, slots=True)
class Approval:
    """An approval handler's answer.

    Attributes:
        behavior: ``allow`` or ``deny``.
        arguments: For an allow, arguments to run the tool with instead of the model's.
        remember: Give the same answer to later asks for this tool in this run (an edit
            applies to its own call only; later calls are allowed with their own arguments).
        reason: Why (a denial's reason reaches the model).
        by: Who decided, for the audit log.
    """

    behavior: Literal["allow", "deny"]
    arguments: Mapping[str, Any] | None = None
    remember: bool = False
    reason: str = ""
    by: str | None = None

    def __post_init__(self) -> None:
        # Built by a handler: a bad answer raises there, and a handler that raises denies.
        if self.behavior not in ("allow", "deny"):
            raise UserError(f"an approval is 'allow' or 'deny', not {self.behavior!r}")
        if self.arguments is not None and not isinstance(self.arguments, Mapping):
            raise UserError(
                f"approval arguments must be a mapping of argument names to values, not "
                f"{type(self.arguments).__name__}"
            )
        if not isinstance(self.reason, str):
            raise UserError(f"an approval's reason must be text, not {self.reason!r}")
        # Whoever decided becomes the audit entry's actor (approver:<by>): the rules of ids,
        # as for decided_by of a deferred approval. "" names nobody, like None.
        if self.by != "":
            check_id("by", self.by)

    @classmethod
    def allow(cls, *, remember: bool = False, reason: str = "", by: str | None = None) -> Approval:
        return cls("allow", None, remember, reason, by)

    @classmethod
    def deny(cls, reason: str = "", *, remember: bool = False, by: str | None = None) -> Approval:
        return cls("deny", None, remember, reason, by)

    @classmethod
    def edit(
        cls,
        arguments: Mapping[str, Any],
        *,
        remember: bool = False,
        reason: str = "",
        by: str | None = None,
    ) -> Approval:
        """Allow the call with ``arguments`` instead of the model's."""
        return cls("allow", dict(arguments), remember, reason, by)


class _Unanswered(Approval):
    """The denial of an ask nobody answered (no handler, a timeout, a failed handler): the
    policy's, not an approver's, on the audit trail."""

    __slots__ = ()


ApprovalHandler: TypeAlias = Callable[
    [ApprovalRequest], "Approval | bool | Awaitable[Approval | bool]"
]
"""Sync or async; ``True``/``False`` are short for allow/deny."""


class StandardPermissions:
    """Rules, modes and approvals for tool calls (see the module docstring).

    Args:
        mode: The mode for everyone (a role's or user's policy may set another; a user's wins,
            and among roles the strictest).
        rules: Rules for everyone (policy ``global``).
        users: Policies by user id (policy ``user:<id>``).
        roles: Policies by role name (policy ``role:<name>``); a run's roles come from
            ``metadata["role"]``.
        approval: The handler for ``ask`` decisions; without one they are denied. ``"defer"``
            stops the run at the call instead (``interruption_reason="approval"``, the requests
            on ``RunResult.pending_approvals``); ``agent.resume(..., approvals={...})`` or
            ``loomflow approvals approve|deny`` decides later, from any process. Needs a
            journaled runtime.
        approval_timeout: Seconds a handler may take before the call is denied; ``None``
            waits forever (not used with ``"defer"``).

    Example:
        >>> permissions = StandardPermissions(
        ...     "default",
        ...     [Rule.deny("drop_*"), Rule.ask("send_email", args={"to": "*@external.com"})],
        ...     roles={"admin": Policy(mode="acceptEdits"), "viewer": Policy(mode="readOnly")},
        ...     approval=ask_on_slack,
        ... )  # doctest: +SKIP
    """

    def __init__(
        self,
        mode: Mode = "default",
        rules: Sequence[Rule] = (),
        *,
        users: Mapping[str, Policy] | None = None,
        roles: Mapping[str, Policy] | None = None,
        approval: ApprovalHandler | Literal["defer"] | None = None,
        approval_timeout: float | None = 300.0,
    ) -> None:
        self.base = Policy(rules, mode)
        if mode not in _MODES:
            raise UserError(f"unknown permission mode {mode!r}; use one of {sorted(_MODES)}")
        self.mode: Mode = mode
        for what, given in (("users", users), ("roles", roles)):
            if given is not None and not isinstance(given, Mapping):
                raise UserError(
                    f"{what} must be a mapping of names to Policy objects, not "
                    f"{type(given).__name__}"
                )
        self.users: Mapping[str, Policy] = MappingProxyType(dict(users or {}))
        self.roles: Mapping[str, Policy] = MappingProxyType(dict(roles or {}))
        for what, policies in (("users", self.users), ("roles", self.roles)):
            for key, policy in policies.items():
                if not isinstance(key, str):
                    # User ids and role names are strings: another key never matches a run.
                    raise UserError(f"{what} are keyed by strings, not {key!r}")
                if what == "users":
                    # A key no user id can be (empty, a control character, too long) names
                    # no run's user: that user's rules would never apply.
                    check_id("a users key (a user id)", key, optional=False)
                if not isinstance(policy, Policy):
                    raise UserError(f"{what}[{key!r}] must be a Policy, not {policy!r}")
        self.deferred = isinstance(approval, str) and approval == "defer"
        handler = None if isinstance(approval, str) else approval
        if (isinstance(approval, str) and not self.deferred) or (
            handler is not None and not callable(handler)
        ):
            raise UserError(f"approval must be a callable or 'defer', not {approval!r}")
        if approval_timeout is not None and (
            isinstance(approval_timeout, bool)
            or not isinstance(approval_timeout, int | float)
            or not approval_timeout > 0
        ):
            raise UserError(
                f"approval_timeout must be a positive number of seconds or None, not "
                f"{approval_timeout!r}"
            )
        self.approval: ApprovalHandler | None = handler
        self.approval_timeout = approval_timeout

    def __repr__(self) -> str:
        return (
            f"StandardPermissions(mode={self.mode!r}, rules={len(self.base.rules)}, "
            f"users={sorted(self.users)}, roles={sorted(self.roles)})"
        )

    def as_hooks(self) -> PermissionHooks:
        """The hooks an :class:`~loomflow.agent.Agent` calls (``Agent(permissions=...)``)."""
        return PermissionHooks(self)

    def _layers(self, user_id: str | None, roles: Sequence[str]) -> list[tuple[str, Policy]]:
        layers = [("global", self.base)]
        layers += [(f"role:{r}", self.roles[r]) for r in dict.fromkeys(roles) if r in self.roles]
        if user_id is not None and user_id in self.users:
            layers.append((f"user:{user_id}", self.users[user_id]))
        return layers

    @staticmethod
    def _mode(layers: Sequence[tuple[str, Policy]]) -> tuple[Mode, str]:
        roles: list[tuple[Mode, str]] = []
        for name, policy in layers:
            if policy.mode is None:
                continue
            if name.startswith("user:"):
                return policy.mode, name
            if name.startswith("role:"):
                roles.append((policy.mode, name))
        if roles:
            return max(roles, key=lambda pair: _STRICTNESS[pair[0]])
        return layers[0][1].mode or "default", "global"

    def check(
        self,
        call: ToolCall,
        *,
        user_id: str | None = None,
        context: PermissionContext | None = None,
    ) -> Decision:
        """Decide on one call. Never raises for a failing rule: that denies (fail closed).

        Args:
            call: The tool call as the model made it.
            user_id: Whom the run works for (selects the user's policy).
            context: The tool (for its ``edits``/``destructive`` flags), roles and run.
                Without a tool, the call counts as one to a plain tool.
        """
        ctx = context or PermissionContext()
        tool = ctx.tool
        layers = self._layers(user_id, ctx.roles)
        mode, mode_policy = self._mode(layers)
        matched: dict[Behavior, tuple[str, Rule]] = {}
        received = Received(tool, call.arguments)
        for policy_name, policy in layers:
            for rule in policy.rules:
                try:
                    hit = rule.matches(call, tool, received=received)
                except Exception as exc:
                    log.error("permission rule %s raised", rule.describe(), exc_info=exc)
                    return Decision(
                        "deny",
                        f"rule {rule.describe()} of policy {policy_name} failed "
                        f"({type(exc).__name__}: {exc}), so the call is denied",
                        "error",
                        rule,
                    )
                if hit:
                    matched.setdefault(rule.behavior, (policy_name, rule))
        if "deny" in matched:
            return _by_rule("deny", *matched["deny"])
        writes = bool(tool and (tool.edits or tool.destructive))
        if mode == "readOnly" and writes:
            return Decision(
                "deny",
                f"mode readOnly: tool {call.name!r} edits or destroys, and nothing that does may "
                "run",
                mode_policy,
            )
        if mode == "bypass":
            return Decision("allow", "mode bypass: no call needs approval", mode_policy)
        if "ask" in matched:
            return _by_rule("ask", *matched["ask"])
        if "allow" in matched:
            return _by_rule("allow", *matched["allow"])
        if tool is not None and tool.destructive:
            return Decision(
                "ask",
                f"mode {mode}: tool {call.name!r} is destructive and no rule allows it",
                mode_policy,
            )
        if tool is not None and tool.edits and mode == "default":
            return Decision(
                "ask", f"mode default: tool {call.name!r} edits and needs approval", mode_policy
            )
        if tool is not None and tool.edits:
            return Decision("allow", f"mode acceptEdits: tool {call.name!r} edits", mode_policy)
        return Decision(
            "allow", f"mode {mode}: tool {call.name!r} neither edits nor destroys", mode_policy
        )

    async def request_approval(self, request: ApprovalRequest) -> Approval:
        """Ask the approval handler; no handler, an error or a timeout is a denial."""
        if self.approval is None:
            return _Unanswered.deny("the call needs approval and no approval handler is configured")
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.approval_timeout):
                # Handlers are user code that the type hints do not bind: check what came back.
                answer: object = self.approval(request)
                if inspect.isawaitable(answer):
                    answer = await answer
        except TimeoutError:
            return _Unanswered.deny(f"no approval within {self.approval_timeout:g} s")
        except Exception as exc:
            log.error("the approval handler raised", exc_info=exc)
            return _Unanswered.deny(f"the approval handler failed ({type(exc).__name__}: {exc})")
        timeout = self.approval_timeout
        if timeout is not None and time.monotonic() - started > timeout:
            # A sync handler (or blocking work before an await) holds the event loop, so the
            # timeout above cannot fire: an answer that came too late still denies.
            return _Unanswered.deny(f"no approval within {timeout:g} s")
        if isinstance(answer, bool):
            return Approval.allow() if answer else Approval.deny("not approved")
        if isinstance(answer, Approval):
            return answer
        return _Unanswered.deny(f"the approval handler returned {answer!r}, not an Approval")


def _by_rule(behavior: Behavior, policy: str, rule: Rule) -> Decision:
    reason = rule.reason or f"rule {rule.describe()} of policy {policy}"
    return Decision(behavior, reason, policy, rule)


def _event_arguments(
    redactor: Redactor | None, arguments: Mapping[str, Any], tool: Tool[..., Any] | None
) -> dict[str, Any]:
    """The arguments a :class:`PermissionDecided` event carries, hidden as the audit entry
    hides them: the event reaches every in-process hook (exporters, log shippers), which must
    see no more than the compliance record. That is the tool's ``sensitive`` values, values
    under keys that name a secret (``db_password``), secret shapes and personal data, and
    every value of a tool that does not exist. A hook that needs the real values has them in
    ``before_tool_call``."""
    sensitive = tool.sensitive if tool is not None else None
    if redactor is not None:
        return redactor.arguments(arguments, sensitive)
    return redact_arguments(arguments, frozenset(arguments) if sensitive is None else sensitive)


def _checked(
    permissions: StandardPermissions,
    call: ToolCall,
    user_id: str | None,
    context: PermissionContext,
) -> Decision:
    """``permissions.check``, failing closed: a custom subclass's check that raises denies
    (for the model's call and for an approver's edit alike)."""
    try:
        return permissions.check(call, user_id=user_id, context=context)
    except Exception as exc:
        log.error("the permission check raised", exc_info=exc)
        return Decision(
            "deny", f"the permission check failed ({type(exc).__name__}: {exc})", "error"
        )


class PermissionHooks(RunHooks):
    """Plugs :class:`StandardPermissions` into the agent loop, before each live tool call."""

    def __init__(self, permissions: StandardPermissions) -> None:
        self.permissions = permissions
        self._remembered: dict[str, dict[str, Approval]] = {}

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        permissions = self.permissions
        refused: Decision | None = None
        try:
            context = PermissionContext.from_metadata(
                info.ctx.metadata, tool=tool, run_id=info.run_id, session_id=info.session_id
            )
        except UserError as exc:  # roles that name none: the roles' policies are unknown
            context = PermissionContext(tool, (), info.ctx.metadata, info.run_id, info.session_id)
            refused = Decision("deny", f"{exc}, so the call is denied", "error")
        # A call whose sealed values this process does not hold (the run resumed elsewhere):
        # rules judged on placeholders would decide another call. The loop hands it here
        # only when the run journaled an approval request for it; the decision on that
        # request (a denial, or an edit that gives every value) is what applies.
        asked = None
        if permissions.deferred and holds_sealed_argument(call.arguments):
            asked = journaled_request(info, turn, slot)
        if refused is not None:
            decision = refused
        elif asked is not None:
            decision = Decision("ask", asked.reason, asked.policy)
        else:
            decision = _checked(permissions, call, info.user_id, context)
        if decision.behavior == "ask" and tool is None and asked is None:
            # A name the model made up: nobody is asked to approve a tool that does not exist
            # (an approver could only allow an error, and a later hook that answers such
            # names must not run one unapproved).
            decision = Decision(
                "deny",
                f"no tool of that name is registered, so nobody is asked ({decision.reason})",
                decision.policy,
            )
        final: Literal["allow", "deny"] = "deny" if decision.behavior == "deny" else "allow"
        reason, approver, edited, current = decision.reason, None, False, call
        by_approver = False
        # What the approver was shown (an in-process handler is shown more redacted).
        shown_to = redact_arguments(call.arguments, tool.sensitive if tool else frozenset())
        if decision.behavior == "ask":
            remembered = self._remembered.get(info.run_id, {}).get(call.name)
            if remembered is not None:
                answer, approver, by_approver = remembered, remembered.by, True
                reason = f"{answer.behavior} remembered for this run: {answer.reason or reason}"
            elif permissions.deferred:
                # Stops the run (ApprovalPending) until a decision is journaled.
                sensitive = tool.sensitive if tool is not None else frozenset()
                # Sealed: the request as it was journaled shows the arguments (its id and
                # its step's key are made from what it showed).
                shown = (
                    asked.arguments
                    if asked is not None
                    else redact_arguments(call.arguments, sensitive)
                )
                recorded = await deferred_decision(
                    info, turn, slot, call, shown, decision.reason, decision.policy, sensitive
                )
                answer = Approval(
                    recorded.behavior,
                    recorded.arguments,
                    False,
                    recorded.reason,
                    recorded.decided_by,
                )
                approver = answer.by
                by_approver = bool(recorded.request_id)  # "": refused, nobody could be asked
                reason = answer.reason or (
                    f"approved: {decision.reason}"
                    if answer.behavior == "allow"
                    else f"denied by {approver or 'the approver'}"
                )
            else:
                request = ApprovalRequest(
                    call, tool, info.user_id, decision, context, info.redactor
                )
                shown_to = request.redacted_arguments
                answer = await permissions.request_approval(request)
                approver = answer.by
                by_approver = not isinstance(answer, _Unanswered)
                reason = answer.reason or (
                    f"approved: {decision.reason}" if answer.behavior == "allow" else reason
                )
                if answer.remember:
                    self._remembered.setdefault(info.run_id, {})[call.name] = answer
            final = answer.behavior
            if final == "allow" and answer.arguments is not None and remembered is None:
                current = call.model_copy(update={"arguments": dict(answer.arguments)})
                edited = True
                # An edit of the arguments as shown to a person can keep a hidden value's
                # placeholder: the tool must not run with "[REDACTED]" as the value.
                kept = kept_placeholder(shown_to, answer.arguments)
                if kept is not None:
                    final = "deny"
                    reason = (
                        f"the edited arguments keep the redacted value {kept[1]!r} of "
                        f"{kept[0]!r} instead of a value"
                    )
                else:
                    # Edited arguments must still pass the deny rules (an approver cannot
                    # lift them).
                    recheck = _checked(permissions, current, info.user_id, context)
                    if recheck.behavior == "deny":
                        final, reason = "deny", f"the edited arguments are denied: {recheck.reason}"
        if info.redactor is not None:
            # The reason reaches the model, and with it the journal and the model's provider:
            # an approver's note may quote a card number or a key, which the audit entry hides.
            reason = info.redactor.text(reason)
        arguments = _event_arguments(info.redactor, current.arguments, tool)
        info.emit(
            PermissionDecided(
                tool=call.name,
                turn=turn,
                slot=slot,
                decision=decision.behavior,
                final=final,
                reason=reason,
                policy=decision.policy,
                approver=approver,
                arguments=arguments,
                edited=edited,
                by_approver=by_approver,
            )
        )
        if final == "deny":
            return ToolOutcome(
                ok=False, error_type=PERMISSION_DENIED, error=f"permission denied: {reason}"
            )
        return current

    async def run_finished(
        self, info: RunInfo, result: Any | None, error: BaseException | None
    ) -> None:
        self._remembered.pop(info.run_id, None)
