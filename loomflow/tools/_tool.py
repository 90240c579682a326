"""The :class:`Tool` wrapper and the :func:`tool` decorator."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import inspect
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, ParamSpec, TypeVar, cast, overload

from ..context import RunContext, get_run_context
from ..errors import (
    AuditError,
    ConfigurationError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    JournalError,
    PayloadTooLargeError,
    StorageError,
    UserError,
)
from ..runtime import codec
from ._docstring import parse_docstring
from ._outcome import INVALID_ARGUMENTS, TIMEOUT, TOOL_ERROR, ToolOutcome
from ._schema import InvalidArgumentsError, build_binder

__all__ = ["Tool", "as_tool", "tool"]

P = ParamSpec("P")
R = TypeVar("R")

_log = logging.getLogger("loomflow.tools")

# Anthropic and OpenAI both accept tool names matching this pattern and nothing else.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Bodies of sync tools running in threads now, counted so a process that stops its runs
# (a recovery worker on SIGTERM) can tell that one goes on, which cancelling cannot stop.
_threads_lock = threading.Lock()
_threads_running = 0


def tool_threads_running() -> int:
    """How many sync tool bodies are running in threads of this process right now (those a
    cancelled or timed-out call left behind included)."""
    return _threads_running


# Sync tools run in threads of their own, not in the event loop's default executor: that one
# has cpu_count + 4 threads (6 on two cores), and the loop's own DNS lookups (a database
# reconnecting) and the JSONL audit store's file I/O wait for it. A few sync tools stuck on a
# dead socket, which no timeout can stop, would stall every run of the process.
TOOL_THREADS = 64
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _tool_pool() -> ThreadPoolExecutor:
    global _pool
    with _threads_lock:
        # One per process: a forked child must not inherit its parent's threads' bookkeeping.
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(TOOL_THREADS, "loomflow-tool"))
        return _pool[1]


def _in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    global _threads_running
    with _threads_lock:
        _threads_running += 1
    try:
        return fn(*args, **kwargs)
    finally:
        with _threads_lock:
            _threads_running -= 1


class Tool(Generic[P, R]):
    """A function the model may call, with its JSON schema and governance flags.

    A ``Tool`` is still callable like the function it wraps, which keeps direct calls in
    tests trivial; the agent loop uses :meth:`invoke` instead, which validates the model's
    arguments and never raises for a failing tool.

    Attributes:
        fn: The wrapped function.
        name: The name the model calls the tool by.
        description: What the tool does, for the model.
        timeout: Seconds a call may take before it is abandoned, or ``None``.
        destructive: The tool changes or deletes something that cannot be taken back.
        edits: The tool edits files or records (allowed by an "accept edits" permission mode).
        sensitive: Argument names whose values the audit log must redact.
        sensitive_result: The tool's results are sensitive (personal data, say): sealed before
            the journal, checkpoints, memory or the audit log see them.
        is_async: Whether ``fn`` is a coroutine function.
    """

    __name__: str
    __qualname__: str

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
        destructive: bool = False,
        edits: bool = False,
        sensitive: Iterable[str] = (),
        sensitive_result: bool = False,
        blocking: bool | None = None,
        localns: Mapping[str, Any] | None = None,
    ) -> None:
        """Wrap ``fn``; :func:`tool` is the usual way in.

        Args:
            fn: A sync or async function whose parameters are JSON-describable.
            name: Defaults to the function's ``__name__``.
            description: Defaults to the first paragraph of the docstring.
            timeout: Seconds before :meth:`invoke` gives up; ``None`` waits forever.
            destructive: Mark the tool as irreversible for permission policies.
            edits: Mark the tool as an edit for the "accept edits" permission mode.
            sensitive: Argument names to redact in the audit log.
            sensitive_result: Seal every successful result: the model gets the real value,
                every store a ``[sealed-result:…]`` placeholder (see ``loomflow.audit.sealing``).
            blocking: For a sync function: whether it may block (I/O, sleeps), so that it
                runs in a worker thread (the default). ``False`` calls it on the event loop,
                which saves the hand-off to a thread and back (tens of microseconds) for
                quick pure functions; such a call cannot be timed out. Async functions always
                run on the loop.
            localns: Names for resolving string annotations of locally defined types.

        Raises:
            UserError: when the function or an option cannot make a valid tool.
        """
        if isinstance(fn, Tool):
            raise UserError(f"{fn!r} is already a Tool; use as_tool() to accept either")
        if not callable(fn) or isinstance(fn, type):
            raise UserError(f"a tool must wrap a function, got {fn!r}")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise UserError(f"{_label(fn)} is a generator; a tool must return one JSON-like value")
        resolved_name = name if name is not None else getattr(fn, "__name__", None)
        if not isinstance(resolved_name, str) or not _NAME.fullmatch(resolved_name):
            raise UserError(
                f"tool name {resolved_name!r} of {_label(fn)} is not usable: model APIs accept "
                "1-64 letters, digits, '_' or '-'; pass name=..."
            )
        _check_timeout(resolved_name, timeout)
        _check_flags(resolved_name, destructive, edits, sensitive_result, blocking)
        if isinstance(sensitive, str):
            # sensitive="card" would otherwise become {"c", "a", "r", "d"} and redact nothing.
            raise UserError(
                f"tool {resolved_name!r}: sensitive must be a collection of argument names, "
                f'e.g. sensitive=("{sensitive}",)'
            )

        is_async = inspect.iscoroutinefunction(fn)
        if blocking is not None and is_async:
            raise UserError(
                f"tool {resolved_name!r}: blocking= applies to sync functions; an async tool "
                "always runs on the event loop"
            )
        if blocking is False and timeout is not None:
            # A sync call on the loop holds it until it returns: nothing could stop it.
            raise UserError(
                f"tool {resolved_name!r}: a timeout needs blocking=True (a sync call on the "
                "event loop cannot be interrupted)"
            )

        doc = parse_docstring(inspect.getdoc(fn))
        binder = build_binder(fn, doc, localns)
        sensitive_names = frozenset(sensitive)
        unknown = sensitive_names - set(binder.exposed)
        if unknown:
            # A misspelt name here would leak the real argument into the audit log.
            raise UserError(
                f"tool {resolved_name!r}: sensitive names {sorted(unknown)} are not arguments "
                f"of the tool (its arguments: {', '.join(binder.exposed) or 'none'})"
            )

        self.fn: Callable[P, R] = fn
        self.name: str = resolved_name
        self.description: str = doc.summary if description is None else description
        self.timeout: float | None = timeout
        self.destructive: bool = destructive
        self.edits: bool = edits
        self.sensitive: frozenset[str] = sensitive_names
        self.sensitive_result: bool = bool(sensitive_result)
        self.is_async: bool = is_async
        self.blocking: bool = not is_async and blocking is not False
        self._binder = binder
        self._call: Callable[..., Any] = fn  # untyped view for calls built from validated data
        # Copies __name__, __doc__, __wrapped__...; not __dict__, which could clobber `name`.
        functools.update_wrapper(self, fn, updated=())
        if not hasattr(self, "__name__"):
            self.__name__ = self.__qualname__ = self.name  # partials and callable objects

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments (a fresh copy each time; mutate freely)."""
        return copy.deepcopy(self._binder.schema)

    def argument_problem(
        self, arguments: Mapping[str, Any] | None, context: RunContext | None = None
    ) -> str | None:
        """What is wrong with ``arguments`` for this tool (one line per problem), or ``None``.

        The same check :meth:`invoke` makes before the tool runs; nothing is run here.
        """
        try:
            self._binder.bind(arguments, context or RunContext())
        except InvalidArgumentsError as exc:
            return str(exc)
        return None

    def received_arguments(self, arguments: Mapping[str, Any]) -> dict[str, Any] | None:
        """``arguments`` as this tool's function would receive them, after validation
        (``"yes"`` for a ``bool`` is ``True``), by name; ``None`` when they do not validate.
        Permission rules judge these as well as what the model sent."""
        return self._binder.received(arguments)

    def spec(self) -> dict[str, Any]:
        """Return ``{"name", "description", "parameters"}`` for a model request."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the wrapped function directly, bypassing validation and timeouts."""
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        flags = "".join(
            f", {flag}=True"
            for flag in ("destructive", "edits", "sensitive_result")
            if getattr(self, flag)
        )
        return f"Tool(name={self.name!r}{flags})"

    async def invoke(self, arguments: Mapping[str, Any] | None) -> ToolOutcome:
        """Validate ``arguments`` from the model, run the tool and report what happened.

        Never raises for bad arguments, a failing tool or a timeout: each becomes a
        ``ToolOutcome`` with ``ok=False``. Cancellation of the caller and the failures of
        loomflow itself that no model can fix still propagate (see :func:`_stops_the_run`).

        Args:
            arguments: The decoded JSON object the model sent.

        Returns:
            The outcome; ``error_type`` is ``"invalid_arguments"``, ``"tool_error"`` or
            ``"timeout"`` on failure.
        """
        try:
            args, kwargs = self._binder.bind(arguments, get_run_context())
        except InvalidArgumentsError as exc:
            return ToolOutcome(
                ok=False,
                error_type=INVALID_ARGUMENTS,
                error=f"invalid arguments for tool {self.name!r}: {exc}",
            )

        # No deadline to arm without a timeout: asyncio.timeout(None) would be set up and
        # torn down on every call for nothing.
        deadline = asyncio.timeout(self.timeout) if self.timeout is not None else None
        try:
            if deadline is None:
                value = await self._run(args, kwargs)
            else:
                async with deadline:
                    value = await self._run(args, kwargs)
        except TimeoutError as exc:
            if deadline is None or not deadline.expired():
                return self._failure(exc)  # the tool's own TimeoutError, e.g. from an HTTP call
            # An async tool was cancelled at its current await. A sync tool's thread cannot be
            # killed in Python: it runs to completion in the background and its result is
            # dropped. Until then it holds one of the default executor's threads.
            return ToolOutcome(
                ok=False,
                error_type=TIMEOUT,
                error=f"tool {self.name!r} did not finish within {self.timeout:g} s",
            )
        except Exception as exc:
            if _stops_the_run(exc):
                raise
            return self._failure(exc)

        outcome = ToolOutcome(ok=True, value=value)
        try:
            # As journaled (the outcome adds one level of nesting); lone surrogates in its
            # text, which no text column can hold, become U+FFFD here, before the journal.
            outcome = cast(ToolOutcome, codec.valid(outcome))
        except (TypeError, ValueError, RecursionError) as exc:
            _log.warning("tool %r returned an unstorable value: %s", self.name, exc)
            if isinstance(exc, codec.NestingTooDeepError):
                # JSON-like, only too deep: said as such, so the model can ask for less.
                why = f"which {exc}, so it cannot be recorded; return a flatter value"
            else:
                why = (
                    "which cannot be recorded; tools must return JSON-like data or pydantic models"
                )
            return ToolOutcome(
                ok=False,
                error_type=TOOL_ERROR,
                error=f"tool {self.name!r} returned a {type(value).__name__}, {why}",
            )
        return outcome

    async def _run(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if self.is_async:
            # Runs in the caller's task, so it sees the caller's context variables.
            value = await self._call(*args, **kwargs)
        elif not self.blocking:
            value = self._call(*args, **kwargs)
        else:
            # With the caller's contextvars (as to_thread copies them), so get_run_context()
            # works in sync tools too; blocking I/O there never stalls the event loop.
            body = functools.partial(_in_thread, self._call, *args, **kwargs)
            run = functools.partial(contextvars.copy_context().run, body)
            value = await asyncio.get_running_loop().run_in_executor(_tool_pool(), run)
        if inspect.isawaitable(value):
            # A sync-looking callable that returns a coroutine (a wrapped async function).
            value = await value
        return value

    def _failure(self, exc: Exception) -> ToolOutcome:
        # The model gets type and message only; the traceback goes to the developer's logs.
        _log.debug("tool %r raised", self.name, exc_info=exc)
        message = str(exc)
        error = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
        return ToolOutcome(ok=False, error_type=TOOL_ERROR, error=error)


_LOOMFLOWS_OWN = (ConfigurationError, UserError, JournalError, StorageError, AuditError)


def _stops_the_run(exc: Exception) -> bool:
    """Whether a tool's exception is loomflow's own failure, which stops the run.

    A deployment mistake (a sub-agent on another journal), a misuse of the API (a step name
    used twice, a step outside a run), the journal's or a store's failure (a strict replay's
    divergence, a lost lease, a database down) or the audit log's: no model can fix these, and
    as a tool error they would be journaled as the call's outcome and replayed for good, after
    the code or the database was fixed. A bad value (an id, a result over the size cap) may
    come from the model's arguments, so the model is told and can try others.
    """
    if isinstance(exc, InvalidArgumentError | PayloadTooLargeError):
        return False
    return isinstance(exc, _LOOMFLOWS_OWN)


def _label(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _caller_locals(depth: int) -> dict[str, Any] | None:
    """The local namespace ``depth`` frames above the caller, unless it is a module's."""
    frame = sys._getframe(depth + 1)
    if frame.f_code.co_name == "<module>":
        return None  # module globals are already the function's own globals
    return dict(frame.f_locals)


@overload
def tool(fn: Callable[P, R], /) -> Tool[P, R]: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    destructive: bool = False,
    edits: bool = False,
    sensitive: Iterable[str] = (),
    sensitive_result: bool = False,
    blocking: bool | None = None,
) -> Callable[[Callable[P, R]], Tool[P, R]]: ...


def tool(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    destructive: bool = False,
    edits: bool = False,
    sensitive: Iterable[str] = (),
    sensitive_result: bool = False,
    blocking: bool | None = None,
) -> Tool[P, R] | Callable[[Callable[P, R]], Tool[P, R]]:
    """Turn a function into a :class:`Tool`, bare or with options.

    The JSON schema comes from the signature and type hints; the description from the
    docstring's first paragraph; argument descriptions from its ``Args:`` section. A
    parameter annotated ``RunContext`` is filled with :func:`~loomflow.get_run_context`
    and hidden from the model.

    Example:
        >>> @tool(timeout=10, sensitive=("card_number",))
        ... def charge(card_number: str, cents: int) -> str:
        ...     '''Charge a card.
        ...
        ...     Args:
        ...         card_number: The full card number.
        ...         cents: Amount to charge, in cents.
        ...     '''
        ...     return "ok"
        >>> @tool(sensitive_result=True)  # the customer record never reaches a store
        ... def lookup_customer(customer_id: str) -> dict[str, str]:
        ...     '''Find a customer's contact details.'''
        ...     return {"email": "ana@example.com"}
        >>> @tool(blocking=False)  # quick and pure: called on the event loop, no thread
        ... def add(a: int, b: int) -> int:
        ...     '''Add two numbers.'''
        ...     return a + b

    Raises:
        UserError: when the function or an option cannot make a valid tool.
    """
    # Captured here, in the decorating frame, so tools defined inside functions can use
    # types that exist only in that function's scope.
    localns = _caller_locals(1)

    def wrap(func: Callable[P, R]) -> Tool[P, R]:
        return Tool(
            func,
            name=name,
            description=description,
            timeout=timeout,
            destructive=destructive,
            edits=edits,
            sensitive=sensitive,
            sensitive_result=sensitive_result,
            blocking=blocking,
            localns=localns,
        )

    return wrap if fn is None else wrap(fn)


@overload
def as_tool(obj: Tool[P, R], /) -> Tool[P, R]: ...


@overload
def as_tool(obj: Callable[P, R], /) -> Tool[P, R]: ...


def as_tool(obj: Tool[P, R] | Callable[P, R], /) -> Tool[P, R]:
    """Return ``obj`` if it is already a :class:`Tool`, else wrap it with default options.

    Raises:
        UserError: when ``obj`` is neither a Tool nor a usable function.
    """
    if isinstance(obj, Tool):
        return obj
    return Tool(obj, localns=_caller_locals(1))


def _check_flags(
    name: str, destructive: object, edits: object, sensitive_result: object, blocking: object
) -> None:
    """The tool's flags are booleans: a ``"false"`` read from a config file is truthy, and an
    ``""`` is falsy, so either would have turned a governance flag the wrong way silently."""
    flags = {"destructive": destructive, "edits": edits, "sensitive_result": sensitive_result}
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidArgumentTypeError(
                f"tool {name!r}: {flag} must be True or False, not {value!r}"
            )
    if blocking is not None and not isinstance(blocking, bool):
        raise InvalidArgumentTypeError(
            f"tool {name!r}: blocking must be True, False or None, not {blocking!r}"
        )


def _check_timeout(name: str, timeout: object) -> None:
    """A tool's ``timeout=``: ``None`` or a positive number of seconds (``"5"`` is refused
    here rather than by a comparison inside the decorator)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgumentTypeError(
            f"tool {name!r}: timeout must be a number of seconds, not {timeout!r}"
        )
    if not timeout > 0:
        raise UserError(f"tool {name!r}: timeout must be positive, got {timeout!r}")
