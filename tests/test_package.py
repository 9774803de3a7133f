"""The installable package: one top-level name, lazy front doors, and a REST client that stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import distbelief

ROOT = Path(__file__).resolve().parents[1]


def test_front_doors_are_reexported_with_all() -> None:
    from distbelief.api.client import Client
    from distbelief.downpour import train
    from distbelief.sandblaster import minimize
    from distbelief.storage import Dataset, ParameterServer

    expected = {
        "minimize": minimize,
        "train": train,
        "Dataset": Dataset,
        "ParameterServer": ParameterServer,
        "Client": Client,
    }
    for name, value in expected.items():
        assert name in distbelief.__all__
        assert getattr(distbelief, name) is value
    assert set(distbelief.__all__) <= set(dir(distbelief))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'optimise'"):
        distbelief.optimise  # noqa: B018


@pytest.mark.parametrize(
    ("statement", "forbidden"),
    [
        (
            "from distbelief.api.client import Client",
            ("fastapi", "uvicorn", "distributed", "dask", "zarr", "xarray", "pandas"),
        ),
        ("import distbelief", ("fastapi", "uvicorn", "distributed", "dask", "numpy")),
    ],
)
def test_light_imports_stay_light(statement: str, forbidden: tuple[str, ...]) -> None:
    code = f"import sys; {statement}; print(sorted(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", f"{statement!r} imported {out.stdout.strip()}"


def test_every_subpackage_is_mapped_into_the_namespace() -> None:
    # The repository keeps its top-level folders; distbelief/ links each of them so the checkout and the
    # installed wheel import every file as distbelief.*.
    for name in ("storage", "models", "sandblaster", "downpour", "api"):
        link = ROOT / "distbelief" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), name
        module = __import__(f"distbelief.{name}", fromlist=["__name__"])
        assert module.__file__ is not None
        assert Path(module.__file__).resolve().parent == (ROOT / name).resolve()
    assert (ROOT / "distbelief" / "py.typed").exists()


def test_no_module_imports_another_packages_private_module() -> None:
    # docs/architecture.md, "Imports": another package is reached through its __init__ or its internal module.
    # ruff's PLC2701 flags this in the top-level folders; ruff sees distbelief/sklearn as part of one package
    # `distbelief` and lets imports used only in annotations pass, so this test reads every file.
    import ast
    import os

    package = ROOT / "distbelief"
    walk = os.walk(package, followlinks=True)
    paths = [Path(folder, name) for folder, _, names in walk for name in names if name.endswith(".py")]
    assert len(paths) > 50
    crossings = []
    for path in sorted(paths):
        parts = path.relative_to(package).parts
        own = parts[0] if len(parts) > 1 else ""
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                names = target.split(".")
                private = any(name.startswith("_") and not name.startswith("__") for name in names[2:])
                if names[0] == "distbelief" and len(names) > 2 and names[1] != own and private:
                    crossings.append(f"{'/'.join(parts)}:{node.lineno} imports {target}")
    assert not crossings, "\n".join(crossings)
