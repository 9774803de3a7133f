"""The distbelief service: a FastAPI app (REST API, job runner, web dashboard), its Python client and CLI.

The names below load on first use (PEP 562): ``from distbelief.api.client import Client`` needs only httpx
and numpy (xarray once ``Client.metrics`` is called), and never imports FastAPI, uvicorn or Dask.

Examples
--------
>>> from distbelief.api import BackgroundServer, Client, Settings, create_app
>>> with BackgroundServer(create_app(Settings(store="/tmp/distbelief"))) as url:   # doctest: +SKIP
...     Client(url).health()["status"]
'ok'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ApiError", "BackgroundServer", "Client", "JobRunner", "Settings", "create_app"]

_LAZY: dict[str, str] = {
    "ApiError": "distbelief.api.client",
    "BackgroundServer": "distbelief.api._server",
    "Client": "distbelief.api.client",
    "JobRunner": "distbelief.api.runner",
    "Settings": "distbelief.api.settings",
    "create_app": "distbelief.api.main",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from distbelief.api.client import ApiError, Client
    from distbelief.api.main import create_app
    from distbelief.api.runner import JobRunner
    from distbelief.api.settings import Settings

    from ._server import BackgroundServer


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'distbelief.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
