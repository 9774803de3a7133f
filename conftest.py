"""Every module's docstring examples run with the test suite (``--doctest-modules`` over ``distbelief``, in
``pyproject.toml``): no hand-kept list of modules can leave one out.

Examples that need an optional extra are skipped, with the command that installs it, where the extra is
missing (the README's test command installs only ``.[test]``).
"""

from __future__ import annotations

import importlib.util

import pytest

#: Module -> (package its examples import, the install command that brings it).
OPTIONAL_EXTRAS = {
    "distbelief.models._jax": ("jax", 'pip install "distbelief[jax]"'),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.DoctestItem):
            continue
        for module, (package, install) in OPTIONAL_EXTRAS.items():
            if item.name.startswith(module) and importlib.util.find_spec(package) is None:
                item.add_marker(pytest.mark.skip(reason=f"needs {package}: {install}"))
