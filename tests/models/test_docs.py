"""The Examples sections of the models package are run, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["models", "models._base", "models._factory", "models._linear", "models._mlp", "models._specs"]


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
