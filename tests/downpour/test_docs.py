"""The Examples sections of the downpour package are run, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "distbelief.downpour._batches",
    "distbelief.downpour._compress",
    "distbelief.downpour._core",
    "distbelief.downpour._options",
    "distbelief.downpour._partitioned",
    "distbelief.downpour._reference",
    "distbelief.downpour._replica",
    "distbelief.downpour._train",
    "distbelief.downpour._watch",
]


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
