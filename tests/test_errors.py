"""The error tree: every exception class loomflow defines survives a pickle round trip."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
from typing import Any

import pytest

import loomflow
from loomflow import errors
from loomflow.agent.hooks import Interrupt
from loomflow.runtime import codec

# Classes whose __init__ takes fields rather than a message, with representative arguments.
_ARGS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "ApprovalPending": (([],), {}),
    "BudgetExceededError": (("user.tokens_total.daily", 1000.0, 900.0, 50.0, 80.0), {}),
    "Interrupt": (("guardrail:pii", "a card number in the output"), {}),
    "DuplicateStepError": (("send", "[]"), {}),
    "InvalidIdError": (("user_id", "is empty"), {}),
    "JournalEncodeError": (("tool_call_1_0", "socket", "its result", None), {}),
    "LegacyJournalError": (("agent_steps", ("run_id",), ("extra",)), {}),
    "ModelError": (("anthropic", "claude-x", "overloaded", 529), {}),
    "ModelRetryExhaustedError": (("openai", "gpt-x", "rate limited", 429, 4), {}),
    "NestingTooDeepError": (([],), {}),
    "OutputValidationError": (("Weather", "field required", 3, '{"city": 1}'), {}),
    "PayloadTooLargeError": (("model_call_3", 2_000_000, 1_048_576), {}),
    "RunCancelledError": (("order-7", "ana"), {}),
    "ReplayDivergenceError": (("tool_call_2_0", '["run:a#0"]', "a" * 64, "b" * 64), {}),
    "ScriptExhaustedError": (("scripted", "scripted", "no turn 4"), {}),
    "StoreLockedError": (
        ("sqlite write lock held",),
        {"path": "/tmp/journal.db", "pid": 4242, "stopped": True},
    ),
    "UnsupportedValueError": ((object(), "holds an open socket"), {}),
}


def _exception_classes() -> list[type[BaseException]]:
    """Every public exception (and warning) class defined in a loomflow module."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(loomflow.__path__, "loomflow."):
        if info.name.endswith("__main__"):  # runs the CLI on import
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("loomflow")
                # Private classes (_Skipped, _Refused, ...) are caught inside their module.
                and not name.startswith("_")
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


CLASSES = _exception_classes()


def test_the_walk_finds_the_whole_tree() -> None:
    names = {cls.__name__ for cls in CLASSES}
    assert set(errors.__all__) <= names
    assert {"Interrupt", "UnsupportedValueError", "UnknownTagError", "PickledEntryWarning"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_every_exception_survives_pickle(cls: type[BaseException]) -> None:
    args, kwargs = _ARGS.get(cls.__name__, (("something went wrong",), {}))
    error = cls(*args, **kwargs)
    error.add_note("while testing")

    copy = pickle.loads(pickle.dumps(error))  # noqa: TID251 - the round trip under test

    assert type(copy) is cls
    assert str(copy) == str(error)
    assert copy.args == error.args
    assert vars(copy).keys() == vars(error).keys()
    for key, value in vars(error).items():
        assert getattr(copy, key) == value, key


def test_field_shaped_errors_keep_their_fields() -> None:
    # The case the default pickling broke: __init__(step, type_name, where, reason).
    error = errors.JournalEncodeError("s", "Decimalish", "its arguments", "is too odd")
    copy = pickle.loads(pickle.dumps(error))  # noqa: TID251 - the round trip under test
    assert (copy.step, copy.type_name, copy.where, copy.reason) == (
        "s",
        "Decimalish",
        "its arguments",
        "is too odd",
    )
    interrupt = pickle.loads(pickle.dumps(Interrupt("budget:cost", "over")))  # noqa: TID251
    assert (interrupt.reason, interrupt.detail) == ("budget:cost", "over")
    unsupported = pickle.loads(pickle.dumps(codec.UnsupportedValueError(object())))  # noqa: TID251
    assert unsupported.type_name == "object"


def test_storage_errors_are_their_own_branch() -> None:
    for cls in (errors.StoreUnavailableError, errors.StoreLockedError, errors.MigrationError):
        assert issubclass(cls, errors.StorageError)
        assert not issubclass(cls, errors.JournalError)
    assert issubclass(errors.LegacyJournalError, errors.MigrationError)


def test_the_tree_in_the_docstring_lists_every_class() -> None:
    doc = errors.__doc__ or ""
    for name in errors.__all__:
        assert f" {name} " in doc or doc.count(f"── {name}") == 1 or f"    {name}\n" in doc, name


def test_bad_arguments_raise_typed_errors_that_stay_builtin_compatible(tmp_path: Any) -> None:
    from loomflow.audit import AuditLog
    from loomflow.audit.offline import heads_from_json
    from loomflow.storage import SqliteDatabase

    with pytest.raises(errors.InvalidArgumentError, match="on_error") as raised:
        AuditLog(f"jsonl://{tmp_path}/audit.jsonl", on_error="ignore")  # type: ignore[arg-type]
    assert isinstance(raised.value, ValueError)
    with pytest.raises(errors.InvalidArgumentError, match="synchronous"):
        SqliteDatabase(tmp_path / "x.db", synchronous="OFF")
    with pytest.raises(errors.InvalidArgumentError, match="chain head"):
        heads_from_json([{"seq": 1}])
    with pytest.raises(errors.InvalidArgumentTypeError) as typed:
        codec.register_type(int)
    assert isinstance(typed.value, TypeError)
    assert issubclass(errors.ConfigurationError, ValueError)


def test_a_single_attempt_is_counted_in_the_singular() -> None:
    one = errors.ModelRetryExhaustedError("openai", "gpt-x", "reset", None, 1)
    assert "failed after 1 attempt;" in str(one)
    four = errors.ModelRetryExhaustedError("openai", "gpt-x", "rate limited", 429, 4)
    assert "failed after 4 attempts;" in str(four)
