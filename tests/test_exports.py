"""The public surface is deliberate: every ``__all__`` is sorted, unique and resolves.

Checked for every package ``__init__`` and every public module (no ``_`` in its dotted
name). The order is plain ``sorted()`` (constants, classes and functions interleave by
code point), which ruff's isort-style RUF022 would reorder; so that rule stays off.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import pytest

import loomflow

# Public modules that are entry points, not libraries: nothing to import from them.
_NO_ALL = {"loomflow.cli", "loomflow.cli.demo", "loomflow.cli.main", "loomflow.testing"}


def _public_modules() -> list[ModuleType]:
    modules = [loomflow]
    for info in pkgutil.walk_packages(loomflow.__path__, "loomflow."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue  # private modules and __main__
        modules.append(importlib.import_module(info.name))
    return modules


MODULES = _public_modules()


def test_the_walk_sees_every_package() -> None:
    names = {m.__name__ for m in MODULES}
    assert {"loomflow", "loomflow.runtime", "loomflow.errors", "loomflow.storage"} <= names
    assert len(names) > 50


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_is_sorted_unique_and_resolves(module: ModuleType) -> None:
    if module.__name__ in _NO_ALL:
        assert not hasattr(module, "__all__") or list(module.__all__) == sorted(module.__all__)
        return
    names = list(module.__all__)
    assert names, module.__name__
    assert names == sorted(names), module.__name__
    assert len(set(names)) == len(names), module.__name__
    for name in names:
        assert hasattr(module, name), f"{module.__name__}.{name}"


def test_new_error_classes_are_exported() -> None:
    import loomflow.errors

    for name in ("InvalidArgumentError", "InvalidArgumentTypeError", "StorageError"):
        assert name in loomflow.errors.__all__
