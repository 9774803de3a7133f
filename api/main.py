"""The FastAPI application: ``create_app(settings)`` wires routers, runner, cluster and dashboard.

The Dask cluster is an embedded ``LocalCluster`` unless ``settings.scheduler`` names one, or a client is
passed in (tests share one cluster that way). It starts with the app and is closed with it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
import dask
from distributed import Client, LocalCluster
from fastapi import APIRouter, Depends, FastAPI, HTTPException
from fastapi.responses import FileResponse, RedirectResponse
from starlette.types import Receive, Scope, Send

from distbelief.api.deps import require_token
from distbelief.api.routes import cluster, datasets, health, jobs
from distbelief.api.routes import models as models_route
from distbelief.api.runner import JobRunner
from distbelief.api.settings import Settings, check_exposure, is_loopback, version
from distbelief.storage import scheduler_identity

from ._docs import add_docs
from ._fastpath import StatusReadFastPath
from ._http import BodyLimitMiddleware, UnexpectedErrorMiddleware, install_error_handlers
from ._jobstore import JobStore

__all__ = ["Backend", "create_app", "dask_dashboard_address"]

log = logging.getLogger("distbelief.api")

DASHBOARD = Path(__file__).parent / "dashboard"
_DASHBOARD_FILES = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
# The dashboard loads nothing from anywhere else (no CDN): say so to the browser.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


@dataclass
class Backend:
    """The Dask client, the store and the runner of a running app."""

    client: Client
    store: JobStore
    runner: JobRunner
    embedded: bool
    dashboard_url: str | None
    _close: list[Callable[[], Any]] = field(default_factory=list)

    @classmethod
    def start(cls, settings: Settings, client: Client | None = None) -> Backend:
        """Connect (or start) the cluster, open the store, and take up the stored jobs."""
        closers: list[Callable[[], Any]] = []
        try:
            embedded = client is None and settings.scheduler is None
            if client is None:
                # Dask keeps a log of recent messages on every batched stream (the client's, and the embedded
                # scheduler's, which lives in this process); the actor handles sent in them would keep every
                # job's shards alive on the workers. Keep no such log.
                with dask.config.set({"distributed.admin.low-level-log-length": 0}):
                    client = _connect(settings, closers)
                closers.append(client.close)
            store = JobStore(settings.store)
            for leftover in store.clean_leftovers():  # of writes a killed server did not finish
                log.info("removed %s, left by an interrupted write", leftover)
            runner = JobRunner(settings, store, client)
            runner.start()
        except BaseException:
            for close in reversed(closers):
                with contextlib.suppress(Exception):
                    close()
            raise
        # Without bokeh an embedded scheduler's dashboard page only says to install bokeh: link nothing.
        has_dashboard = not embedded or (
            importlib.util.find_spec("bokeh") is not None and dask_dashboard_address(settings) is not None
        )
        dashboard = _dashboard_url(settings, client) if has_dashboard else settings.dask_dashboard_url
        return cls(client, store, runner, embedded, dashboard, closers)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the runner (running jobs stay resumable), then the client and an embedded cluster."""
        try:
            self.runner.stop(timeout)
        finally:
            for close in reversed(self._close):
                with contextlib.suppress(Exception):
                    close()


def _connect(settings: Settings, closers: list[Callable[[], Any]]) -> Client:
    if settings.scheduler is not None:
        return Client(settings.scheduler, direct_to_workers=True, timeout="30s")
    dashboard = dask_dashboard_address(settings)
    cluster = LocalCluster(
        n_workers=settings.n_workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=dashboard,
        # Off, the scheduler still serves its HTTP routes (health, metrics, logs): on loopback, a free port.
        scheduler_kwargs=None if dashboard else {"dashboard": False, "dashboard_address": "127.0.0.1:0"},
    )
    closers.append(cluster.close)
    return Client(cluster, direct_to_workers=True)


def dask_dashboard_address(settings: Settings) -> str | None:
    """Where the embedded cluster's Dask dashboard listens, or None for no dashboard.

    ``settings.dask_dashboard_address`` if set (``off`` for none); else a free port on the API's host when
    that is a loopback address, and none otherwise: the Dask dashboard has no authentication (its pages show
    the workers' logs and profiles), so it is never put on an address that the token guards.

    Examples
    --------
    >>> dask_dashboard_address(Settings(host="127.0.0.1"))
    '127.0.0.1:0'
    >>> dask_dashboard_address(Settings(host="0.0.0.0", api_token="t" * 16)) is None
    True
    >>> dask_dashboard_address(Settings(host="0.0.0.0", api_token="t" * 16, dask_dashboard_address="off"))
    """
    configured = settings.dask_dashboard_address
    if configured is not None:
        return None if configured.strip().lower() in ("off", "none", "false", "0") else configured.strip()
    if not is_loopback(settings.host):
        return None
    host = settings.host.strip("[]")
    if host == "localhost":
        host = "127.0.0.1"
    return f"[{host}]:0" if ":" in host else f"{host}:0"  # port 0: never take 8787 from another cluster


def _dashboard_url(settings: Settings, client: Client) -> str | None:
    if settings.dask_dashboard_url:
        return settings.dask_dashboard_url
    try:
        info = scheduler_identity(client)
    except Exception:
        return None
    port = (info.get("services") or {}).get("dashboard")
    if not port:
        return None
    host = str(info.get("address", "")).split("://")[-1].rsplit(":", 1)[0] or "127.0.0.1"
    return f"http://{host}:{port}/status"


def create_app(settings: Settings | None = None, *, client: Client | None = None) -> FastAPI:
    """Build the service.

    Parameters
    ----------
    settings : Settings, optional
        Default: read from the ``DISTBELIEF_*`` environment.
    client : distributed.Client, optional
        Run jobs on this client instead of connecting to ``settings.scheduler`` or starting an embedded
        cluster (the caller keeps ownership of it).

    Raises
    ------
    distbelief.errors.InvalidOptionError
        ``settings.host`` is not a loopback address and no ``api_token`` is set.

    Examples
    --------
    >>> import uvicorn
    >>> app = create_app(Settings(store="/tmp/distbelief"))
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)   # doctest: +SKIP
    """
    settings = settings if settings is not None else Settings()
    check_exposure(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Starting a LocalCluster blocks for seconds: keep it off the event loop.
        backend = await anyio.to_thread.run_sync(Backend.start, settings, client)
        # The runner collects garbage as jobs end (to free their actors); a full collection walks every
        # tracked object, and the millions that the imports made (numpy, scipy, xarray, dask, zarr) live as
        # long as the process. Move them out of the collector's sight once: a collection then costs
        # milliseconds instead of ~0.1-0.3 s of holding the GIL (which stalled every request meanwhile).
        gc.collect()
        gc.freeze()
        backend.runner.freeze_after_first_job = True
        app.state.backend = backend
        app.state.runner = backend.runner
        try:
            yield
        finally:
            app.state.runner = None
            await anyio.to_thread.run_sync(backend.close)
            gc.unfreeze()  # what was frozen at the start is the collector's again

    app = _Service(
        title="distbelief",
        version=version(),
        summary="Sandblaster L-BFGS and Downpour SGD on Dask, as a service",
        lifespan=lifespan,
        # /docs and /redoc are served with their assets by add_docs: FastAPI's own pages need a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.runner = None
    app.add_middleware(
        BodyLimitMiddleware, limit=settings.max_body_bytes, upload_limit=settings.max_upload_bytes
    )
    # Added last, so it wraps the others: an unexpected error anywhere below is a JSON 500 on a connection
    # that stays open.
    app.add_middleware(UnexpectedErrorMiddleware)
    install_error_handlers(app)

    guarded = APIRouter(dependencies=[Depends(require_token)])
    for module in (jobs, datasets, models_route, cluster):
        guarded.include_router(module.router)
    app.include_router(guarded, prefix="/api")
    app.include_router(health.router, prefix="/api")
    add_docs(app)
    _add_dashboard(app)
    return app


class _Service(FastAPI):
    """The app, with :class:`~distbelief.api._fastpath.StatusReadFastPath` in front of everything.

    In front of FastAPI's and Starlette's own layers too (error middleware, telemetry, the app's body
    limit), which ``add_middleware`` cannot reach: under load they were a third of a status read's cost in
    the app. Every request that path does not answer goes through the whole app as before.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._front = StatusReadFastPath(super().__call__, state=self.state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._front(scope, receive, send)


def _add_dashboard(app: FastAPI) -> None:
    headers = {
        "Content-Security-Policy": _CSP,
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache",
    }

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD / "index.html", media_type="text/html", headers=headers)

    @app.get("/dashboard/{name}", include_in_schema=False)
    def dashboard_file(name: str) -> FileResponse:
        # Only the files listed: a name is never used as a path.
        if name not in _DASHBOARD_FILES:
            raise HTTPException(404, f"no dashboard file {name!r}")
        return FileResponse(DASHBOARD / name, media_type=_DASHBOARD_FILES[name], headers=headers)

    @app.get("/dashboard", include_in_schema=False)
    def dashboard_redirect() -> RedirectResponse:
        return RedirectResponse("/")
