"""Checks of what ``Agent(...)`` is given, so a misplaced argument fails where it is written.

Without them a single tool passed as ``tools=``, a path passed as ``runtime=`` or a dict passed
as ``tuning=`` surfaced as a bare ``TypeError`` or ``AttributeError`` from deep inside the
constructor, or from the first run. Each check takes ``object``: what a caller passes is
checked here, not trusted to match the annotations.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from ..errors import InvalidArgumentTypeError, UserError
from ..hooks import HookProvider, RunHooks
from ..runtime import Runtime
from ..tools import Tool
from ._types import Tuning

__all__ = [
    "check_list",
    "check_max_turns",
    "check_metadata",
    "check_plugin",
    "check_runtime",
    "check_tuning",
]

# What each component parameter takes, as the error message shows it.
PLUGIN_EXAMPLES = {
    "budget": "a budget such as StandardBudget([Cap('cost_usd', 2.0, window='day')])",
    "permissions": "a policy such as StandardPermissions('default', [Rule.deny('delete_*')])",
    "audit": "an audit log such as AuditLog('sqlite:///journal.db')",
    "telemetry": "a Telemetry(...), None for the default or False for none",
}


def _describe(value: object) -> str:
    if isinstance(value, Tool):
        return f"the single tool {value.name!r}"
    if callable(value) and hasattr(value, "__name__"):
        return f"the single function {value.__name__!r}"
    return f"a {type(value).__name__}"


def check_list(parameter: str, value: object, kind: str) -> None:
    """Refuse a ``tools=``, ``guardrails=`` or ``hooks=`` that is not a list of ``kind``.

    Raises:
        InvalidArgumentTypeError: for ``None``, a string, a mapping or a single component.
    """
    if value is None:
        raise InvalidArgumentTypeError(
            f"{parameter}= takes a list of {kind}, not None: leave it out for none"
        )
    if isinstance(value, Mapping):
        raise InvalidArgumentTypeError(
            f"{parameter}= takes a list of {kind}, not a {type(value).__name__}: "
            f"pass its values, {parameter}=list(the_{type(value).__name__}.values())"
        )
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or callable(value):
        name = value.name if isinstance(value, Tool) else getattr(value, "__name__", "...")
        raise InvalidArgumentTypeError(
            f"{parameter}= takes a list of {kind}, not {_describe(value)}: "
            f"write {parameter}=[{name}]"
        )


def check_runtime(value: object) -> None:
    """Refuse a ``runtime=`` that is not a journal runtime (a path or a URL, most often).

    Raises:
        InvalidArgumentTypeError: naming the runtime to build instead.
    """
    if value is None or isinstance(value, Runtime):  # the protocol: a runtime of one's own too
        return
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str) and text.startswith(("postgresql:", "postgres:")):
            build = f"await PostgresRuntime.connect({text!r})"
        else:
            build = f"SqliteRuntime({text!r})"
        raise InvalidArgumentTypeError(
            f"runtime= takes a runtime object, not the path or URL {text!r}: write "
            f"runtime={build} (from loomflow.runtime)"
        )
    raise InvalidArgumentTypeError(
        "runtime= takes a SqliteRuntime, PostgresRuntime or InMemoryRuntime (from "
        "loomflow.runtime; or a runtime of your own with what loomflow.runtime.Runtime lists), "
        f"or None for no journal, not {_describe(value)}"
    )


def check_tuning(value: object) -> None:
    """Refuse a ``tuning=`` that is not a :class:`Tuning`.

    Raises:
        InvalidArgumentTypeError: for a dict (``Tuning(**it)`` is what was meant) or anything else.
    """
    if value is None or isinstance(value, Tuning):
        return
    example = "Tuning(**the_dict)" if isinstance(value, Mapping) else "Tuning(checkpoint=True)"
    raise InvalidArgumentTypeError(
        f"tuning= takes a loomflow.Tuning(...), not {_describe(value)}: write tuning={example}"
    )


def check_max_turns(value: object) -> None:
    """Refuse a ``max_turns`` that is not a whole number of at least 1.

    Raises:
        InvalidArgumentTypeError: naming the value.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentTypeError(f"max_turns must be a whole number, not {value!r}")
    if value < 1:
        raise UserError(f"max_turns must be at least 1, not {value}")


def check_plugin(parameter: str, value: object) -> None:
    """Refuse a ``budget=``, ``permissions=``, ``audit=`` or ``telemetry=`` that cannot plug
    into the loop, naming the parameter and what it takes.

    Raises:
        InvalidArgumentTypeError: for what is neither a ``RunHooks`` nor has ``as_hooks()``.
    """
    if value is None or isinstance(value, (HookProvider, RunHooks)):
        return
    if parameter == "telemetry" and value is False:
        return
    raise InvalidArgumentTypeError(
        f"{parameter}= takes {PLUGIN_EXAMPLES[parameter]}, not {_describe(value)} (which is "
        "not a RunHooks and has no as_hooks())"
    )


def check_metadata(value: object) -> None:
    """Refuse a run's ``metadata=`` that is not a mapping (a list of keys, say), which used to
    fail as a bare ``ValueError`` from ``dict()``.

    Raises:
        InvalidArgumentTypeError: naming what was given.
    """
    if value is None or isinstance(value, Mapping):
        return
    raise InvalidArgumentTypeError(
        f"metadata must be a mapping such as {{'role': 'support'}}, not {_describe(value)}"
    )
