"""distbelief: DistBelief's Sandblaster L-BFGS and Downpour SGD on Dask, with a sharded parameter server.

The front doors are re-exported here; each lives in its own subpackage (``distbelief.sandblaster``,
``distbelief.downpour``, ``distbelief.storage``, ``distbelief.models``, ``distbelief.api``).

They are loaded on first use (PEP 562), so ``from distbelief.api.client import Client`` on a laptop that
only talks to a service imports neither Dask nor FastAPI.

Examples
--------
>>> import distbelief
>>> from distbelief import models
>>> X, y = distbelief.storage.load_digits()
>>> res = distbelief.minimize(models.Softmax(64, 10), (X, y.astype(float)), l2=1e-3)  # doctest: +SKIP
>>> res.success                                                                     # doctest: +SKIP
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

__all__ = [
    "Client",
    "Dataset",
    "ParameterServer",
    "__version__",
    "api",
    "downpour",
    "errors",
    "minimize",
    "models",
    "sandblaster",
    "storage",
    "train",
]

# name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "minimize": ("distbelief.sandblaster", "minimize"),
    "train": ("distbelief.downpour", "train"),
    "Dataset": ("distbelief.storage", "Dataset"),
    "ParameterServer": ("distbelief.storage", "ParameterServer"),
    "Client": ("distbelief.api.client", "Client"),
    "api": ("distbelief.api", None),
    "downpour": ("distbelief.downpour", None),
    "errors": ("distbelief.errors", None),
    "models": ("distbelief.models", None),
    "sandblaster": ("distbelief.sandblaster", None),
    "storage": ("distbelief.storage", None),
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from distbelief import api, downpour, errors, models, sandblaster, storage
    from distbelief.api.client import Client
    from distbelief.downpour import train
    from distbelief.sandblaster import minimize
    from distbelief.storage import Dataset, ParameterServer


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'distbelief' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
