"""The Examples sections of the new modules and constructors of issue 16 run, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib
from typing import Any

import pytest

from distbelief.storage import Dataset

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize(
    "name", ["distbelief.sklearn._base", "distbelief.sklearn._from_model", "distbelief.models._jax"]
)
def test_module_examples_run(name: str) -> None:
    if name.endswith("_jax"):
        pytest.importorskip("jax", reason='JaxModel needs JAX: pip install "distbelief[jax]"')
    result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS, verbose=False)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


@pytest.mark.parametrize("method", [Dataset.from_dask, Dataset.from_xarray])
def test_constructor_examples_run(method: Any) -> None:
    import dask

    runner = doctest.DocTestRunner(optionflags=FLAGS)
    tests = doctest.DocTestFinder().find(method, globs={"Dataset": Dataset})
    with dask.config.set(scheduler="sync"):
        for test in tests:
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0
