"""The Examples sections of the api package are run, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "distbelief.api.settings",
    "distbelief.api.schemas",
    "distbelief.api._jobstore",
    "distbelief.api._http",
    "distbelief.api.client",
    "distbelief.api.main",
    "distbelief.api._docs",
    "distbelief.api.cli",
    "distbelief.api.runner",
]


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DISTBELIEF_API_TOKEN", "DISTBELIEF_HOST", "DISTBELIEF_STORE"):
        monkeypatch.delenv(var, raising=False)
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
