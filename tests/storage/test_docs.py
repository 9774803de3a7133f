"""The Examples sections of the storage modules are run, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize(
    "name",
    [
        "distbelief.storage._dataset",
        "distbelief.storage._sparse",
        "distbelief.storage._rowcache",
        "distbelief.storage._exchange",
        "distbelief.storage._layout",
        "distbelief.storage._partition_layout",
        "distbelief.storage._keys",
        "distbelief.storage._vectorstore",
        "distbelief.storage._exactsum",
        "distbelief.storage._shard",
    ],
)
def test_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
