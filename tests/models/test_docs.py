"""The Examples sections of the models package are run, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "distbelief.models",
    "distbelief.models._base",
    "distbelief.models._factory",
    "distbelief.models._linear",
    "distbelief.models._local",
    "distbelief.models._mlp",
    "distbelief.models._partitioned",
    "distbelief.models._specs",
]


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
