"""The crash tests' process harness (``tests/crash/_harness.py``), for tests elsewhere.

Loaded by path, so that a test module does not depend on which test directories pytest
happened to put on ``sys.path``; one module object whoever loads it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_NAME = "_loomflow_process_harness"


def _load() -> ModuleType:
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(
        _NAME, Path(__file__).resolve().parent / "crash" / "_harness.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


harness = _load()
