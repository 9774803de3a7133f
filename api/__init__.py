"""The distbelief service: a FastAPI app (REST API, job runner, web dashboard), its Python client and CLI.

Examples
--------
>>> from api import BackgroundServer, Client, Settings, create_app
>>> with BackgroundServer(create_app(Settings(store="/tmp/distbelief"))) as url:   # doctest: +SKIP
...     Client(url).health()["status"]
'ok'
"""

from api._server import BackgroundServer
from api.client import ApiError, Client
from api.main import create_app
from api.runner import JobRunner
from api.settings import Settings

__all__ = ["ApiError", "BackgroundServer", "Client", "JobRunner", "Settings", "create_app"]
