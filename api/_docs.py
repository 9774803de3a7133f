"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) served with no network: their assets come from the app.

FastAPI's own pages load Swagger UI and ReDoc from a CDN (and ReDoc its fonts from Google), so on a machine
without internet access they stay blank. The ``fastapi-offline`` package ships the same files (MIT licensed);
the app serves them under ``/docs-assets/`` and the two pages point there, the way FastAPI's documentation
self-hosts them (``docs_url=None``, then ``get_swagger_ui_html(swagger_js_url=..., swagger_css_url=...)``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

from distbelief.errors import InvalidOptionError

__all__ = ["ASSETS_PREFIX", "add_docs", "assets_dir"]

#: Where the Swagger UI and ReDoc files are served.
ASSETS_PREFIX = "/docs-assets"
_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}


# The pages may load from this host only. Swagger UI's page runs an inline script, both UIs set inline styles,
# ReDoc runs its search in a blob: worker, and ReDoc's menu shows a logo from its vendor's CDN: the browser
# refuses that one (the menu then shows the text link alone).
_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
    "base-uri 'none'; frame-ancestors 'none'"
)


def _local_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = _CSP
    return page


def assets_dir() -> Path:
    """The folder of the installed ``fastapi-offline`` package that holds Swagger UI's and ReDoc's files.

    Raises
    ------
    distbelief.errors.InvalidOptionError
        ``fastapi-offline`` is not installed (it is a dependency of distbelief).

    Examples
    --------
    >>> sorted(p.name for p in assets_dir().iterdir() if p.suffix == ".js")
    ['redoc.standalone.js', 'swagger-ui-bundle.js']
    """
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or spec.origin is None:
        raise InvalidOptionError(
            "the API documentation pages need the fastapi-offline package: pip install fastapi-offline "
            "(or reinstall distbelief, which depends on it)"
        )
    return Path(spec.origin).parent / "static"


def add_docs(app: FastAPI) -> None:
    """Serve ``/docs``, ``/docs/oauth2-redirect``, ``/redoc`` and their assets from ``app`` itself.

    ``app`` must have been created with ``docs_url=None, redoc_url=None``.

    Examples
    --------
    >>> app = FastAPI(title="t", docs_url=None, redoc_url=None)
    >>> add_docs(app)
    >>> sorted(route.path for route in app.routes if "doc" in route.path)
    ['/docs', '/docs-assets/{name}', '/docs/oauth2-redirect', '/redoc']
    """
    folder = assets_dir()
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    def urls(request: Request) -> dict[str, str]:
        # Behind a proxy that mounts the app under a prefix, every URL the page loads carries it.
        root = request.scope.get("root_path", "")
        return {"openapi_url": f"{root}{openapi_url}", "assets": f"{root}{ASSETS_PREFIX}"}

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        u = urls(request)
        return _local_only(
            get_swagger_ui_html(
                openapi_url=u["openapi_url"],
                title=f"{app.title} - Swagger UI",
                swagger_js_url=u["assets"] + "/swagger-ui-bundle.js",
                swagger_css_url=u["assets"] + "/swagger-ui.css",
                swagger_favicon_url=u["assets"] + "/favicon.png",
                oauth2_redirect_url=oauth2_redirect,
                # No call to the public validator service: the page must not leave this host.
                swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None},
            )
        )

    app.get(oauth2_redirect, include_in_schema=False)(get_swagger_ui_oauth2_redirect_html)

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        u = urls(request)
        # No Google Fonts: ReDoc falls back to the browser's fonts.
        page = get_redoc_html(
            openapi_url=u["openapi_url"],
            title=f"{app.title} - ReDoc",
            redoc_js_url=u["assets"] + "/redoc.standalone.js",
            redoc_favicon_url=u["assets"] + "/favicon.png",
            with_google_fonts=False,
        )
        return _local_only(page)

    @app.get(ASSETS_PREFIX + "/{name}", include_in_schema=False)
    def docs_asset(name: str) -> FileResponse:
        # Only the files listed: a name is never used as a path.
        if name not in _ASSETS:
            raise HTTPException(404, f"no documentation asset {name!r}")
        return FileResponse(
            folder / name, media_type=_ASSETS[name], headers={"Cache-Control": "public, max-age=86400"}
        )
