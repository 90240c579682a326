"""The public surface of the model layer: explicit, sorted, importable."""

from __future__ import annotations

import importlib

import pytest

MODULES = [
    "loomflow.messages",
    "loomflow.models",
    "loomflow.models.pricing",
    "loomflow.models.scripted",
    "loomflow.testing.providers",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_is_sorted_and_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported)
    for attr in exported:
        assert getattr(module, attr) is not None
