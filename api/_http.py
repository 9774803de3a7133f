"""HTTP plumbing: domain errors as 4xx/5xx with their message, readable validation errors, body limits."""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, cast

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from distbelief.api.runner import DanglingDatasetError, JobNotFoundError, JobStateError, QueueFullError
from distbelief.errors import (
    ClusterError,
    ConflictError,
    DatasetError,
    DistbeliefError,
    InvalidOptionError,
    ModelSpecError,
    ProtocolError,
    ShardLostError,
    StoreError,
)

from ._uploads import UploadTooLargeError

__all__ = [
    "MAX_LISTED_ERRORS",
    "BodyLimitMiddleware",
    "UnexpectedErrorMiddleware",
    "error_responses",
    "install_error_handlers",
    "status_of",
]

#: A 422 lists at most this many problems (and says how many there were): 60,000 bad keys in one body
#: must not make a response of megabytes.
MAX_LISTED_ERRORS = 20
#: ... and its ``detail`` is at most this long.
MAX_DETAIL_CHARS = 4000

_WHY: dict[int, str] = {
    400: "The body is malformed: not valid JSON, not JSON where JSON is expected, a broken multipart "
    "form, or a form with too many fields.",
    401: "No bearer token, or the wrong one (only when the server has DISTBELIEF_API_TOKEN).",
    404: "No such job or dataset.",
    409: "It clashes with the current state: a name that is taken or being uploaded, a dataset a queued or "
    "running job uses, a job that is not finished (or finished already).",
    413: "The body is larger than DISTBELIEF_MAX_BODY_BYTES (DISTBELIEF_MAX_UPLOAD_BYTES for uploads), or "
    "an uploaded archive's arrays would be, once decompressed (DISTBELIEF_MAX_UPLOAD_BYTES).",
    415: "The content type is neither multipart/form-data nor application/json.",
    422: "The request is well formed but invalid: a field out of range, an unknown option, a bad dataset "
    "name, a model that does not fit the dataset, or a job too big for the cluster and the settings.",
    503: "The service is starting or shutting down, the queue is full, or the cluster cannot take the work.",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses a route returns (each body an ``ErrorPublic``).

    Examples
    --------
    >>> sorted(error_responses(404, 409))
    [404, 409]
    """
    from distbelief.api.schemas import ErrorPublic

    return {code: {"model": ErrorPublic, "description": _WHY[code]} for code in codes}


log = logging.getLogger("distbelief.api")

# Most specific first: the first class an error is an instance of decides its status.
_STATUS: list[tuple[type[DistbeliefError], int]] = [
    (JobNotFoundError, status.HTTP_404_NOT_FOUND),
    (JobStateError, status.HTTP_409_CONFLICT),
    (ConflictError, status.HTTP_409_CONFLICT),
    (DanglingDatasetError, status.HTTP_409_CONFLICT),
    (QueueFullError, status.HTTP_503_SERVICE_UNAVAILABLE),
    (UploadTooLargeError, status.HTTP_413_CONTENT_TOO_LARGE),
    (ModelSpecError, status.HTTP_422_UNPROCESSABLE_CONTENT),
    (DatasetError, status.HTTP_422_UNPROCESSABLE_CONTENT),
    (InvalidOptionError, status.HTTP_422_UNPROCESSABLE_CONTENT),
    (ShardLostError, status.HTTP_503_SERVICE_UNAVAILABLE),
    (ClusterError, status.HTTP_503_SERVICE_UNAVAILABLE),
    (StoreError, status.HTTP_500_INTERNAL_SERVER_ERROR),
    (ProtocolError, status.HTTP_500_INTERNAL_SERVER_ERROR),
]


def status_of(exc: DistbeliefError) -> int:
    """The HTTP status of a domain error.

    Examples
    --------
    >>> status_of(DatasetError("bad")), status_of(ClusterError("down"))
    (422, 503)
    """
    return next(
        (code for cls, code in _STATUS if isinstance(exc, cls)), status.HTTP_500_INTERNAL_SERVER_ERROR
    )


def _where(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts)


def _describe(err: dict[str, Any]) -> str:
    where = _where(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid"))
    if err.get("type") == "value_error":
        # Our validators raise errors whose messages already say what to fix; drop pydantic's prefix.
        msg = msg.removeprefix("Value error, ")
        return f"{where}: {msg}" if where else msg
    where = where or "body"
    if err.get("type") == "missing":
        return f"{where}: this field is required"
    given = err.get("input")
    shown = json.dumps(given, default=str) if not isinstance(given, dict) else "an object"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{where}: {msg}, got {shown}"


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    err = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if err is not None:
        reason = (err.get("ctx") or {}).get("error", "it could not be parsed")
        return JSONResponse(
            {"detail": f"the request body is not valid JSON ({reason}); send a JSON object"},
            status_code=status.HTTP_400_BAD_REQUEST,
        )
    if (
        len(errors) == 1
        and tuple(errors[0].get("loc", ())) == ("body",)
        and isinstance(errors[0].get("input"), bytes | str)
    ):
        # FastAPI only parses JSON sent as JSON: anything else arrives as raw bytes.
        return JSONResponse(
            {"detail": "the request body must be a JSON object sent with 'Content-Type: application/json'"},
            status_code=status.HTTP_400_BAD_REQUEST,
        )
    shown = errors[:MAX_LISTED_ERRORS]
    problems = [_bounded(_describe(e), MAX_DETAIL_CHARS // 2) for e in shown]
    detail = "; ".join(problems)
    if len(errors) > len(shown):
        detail += f"; and {len(errors) - len(shown)} more problem(s) ({len(errors)} in all): fix these first"
    return JSONResponse(
        {
            "detail": _bounded(detail, MAX_DETAIL_CHARS),
            "errors": [
                {"loc": [p if isinstance(p, int) else str(p) for p in e.get("loc", ())], "msg": p}
                for e, p in zip(shown, problems, strict=True)
            ],
        },
        status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
    )


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 20] + " ... (cut short)"


# An absolute local path: a slash that starts no URL's "//" and no API path ("/api/..."), then at least two
# components. "text/csv", "s3://bucket/key" and "POST /api/jobs/{id}/cancel" are left alone.
_ABSOLUTE_PATH = re.compile(r"(?<![\w/.:~>-])/(?!api/)[^\s'\",;:()\[\]/]+/[^\s'\",;:()\[\]]*")


def redact(text: str, roots: tuple[str, ...] = ()) -> str:
    """``text`` without absolute paths of the server: each of ``roots`` (the store) becomes ``<store>``,
    any other absolute local path ``<server path>``.

    Examples
    --------
    >>> redact("cannot read /srv/db/jobs/1/metrics.zarr: bad", ("/srv/db",))
    'cannot read <store>/jobs/1/metrics.zarr: bad'
    >>> redact("no file '/usr/lib/x.so'; see POST /api/jobs/{id}/cancel or s3://b/k")
    "no file '<server path>'; see POST /api/jobs/{id}/cancel or s3://b/k"
    """
    for root in sorted({r.rstrip("/") for r in roots if r and r.rstrip("/")}, key=len, reverse=True):
        text = text.replace(root, "<store>")
    return _ABSOLUTE_PATH.sub("<server path>", text)


def _store_roots(request: Request) -> tuple[str, ...]:
    settings = getattr(request.app.state, "settings", None)
    store = getattr(settings, "store", None)
    if not isinstance(store, str) or "://" in store:
        return ()
    expanded = os.path.expanduser(store)
    return (store, expanded, os.path.abspath(expanded), os.path.realpath(expanded))


def _detail(request: Request, text: str) -> str:
    return _bounded(redact(text, _store_roots(request)), MAX_DETAIL_CHARS)


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DistbeliefError)
    code = status_of(exc)
    if code >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    return JSONResponse({"detail": _detail(request, str(exc))}, status_code=code)


async def _http_error(request: Request, exc: Exception) -> Response:
    # Starlette's own handler, with the message of the detail redacted like a domain error's.
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.detail, str):
        exc = StarletteHTTPException(exc.status_code, _detail(request, exc.detail), exc.headers)
    return await http_exception_handler(request, exc)


def _internal_error(exc: BaseException) -> JSONResponse:
    return JSONResponse(
        {"detail": f"internal error ({type(exc).__name__}); the server log has the details"},
        status_code=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _internal_error(exc)


class UnexpectedErrorMiddleware:
    """Answer an unexpected exception with a JSON 500 and keep the connection open.

    Starlette sends the response of a handler registered for ``Exception`` from its outermost middleware
    and then raises the exception again, for the server to log; uvicorn then closes the connection, so the
    client's next request on it fails with "connection reset". This middleware sits inside that one: it
    logs the error, answers, and returns normally. An error after the response has started (a stream cut
    short) is raised on: the connection cannot carry a well-formed answer any more.

    Examples
    --------
    >>> app.add_middleware(UnexpectedErrorMiddleware)   # doctest: +SKIP
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            await _internal_error(exc)(scope, receive, send)


def _path_methods(app: FastAPI) -> list[tuple[re.Pattern[str], frozenset[str]]]:
    """Every path template of the app and its methods: the documented ones from the OpenAPI schema (FastAPI
    nests the routes of included routers, which ``app.routes`` does not list), the others from the app's
    own routes. Built once per app."""
    cached = getattr(app.state, "path_methods", None)
    if cached is not None:
        return cast(list[tuple[re.Pattern[str], frozenset[str]]], cached)
    table: dict[str, set[str]] = {}
    for path, operations in (app.openapi().get("paths") or {}).items():
        table.setdefault(path, set()).update(m.upper() for m in operations if m.upper() in _METHODS)
    for route in app.routes:
        if isinstance(route, Route) and route.methods:
            table.setdefault(route.path, set()).update(route.methods)
    out = []
    for path, methods in table.items():
        if "GET" in methods:
            methods.add("HEAD")
        pattern = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(path))
        out.append((re.compile(pattern), frozenset(methods)))
    app.state.path_methods = out
    return out


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


async def _method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
    # Starlette answers 405 with the methods of the first route whose path matched; list every route's
    # (GET and DELETE of /api/jobs/{job_id} are two routes), so Allow says what the resource supports.
    allowed: set[str] = set()
    for pattern, supported in _path_methods(request.app):
        if pattern.fullmatch(request.url.path):
            allowed |= supported
    if not allowed and isinstance(exc, HTTPException) and exc.headers:
        allowed = {m.strip() for m in exc.headers.get("Allow", "").split(",") if m.strip()}
    methods = ", ".join(sorted(allowed))
    return JSONResponse(
        {"detail": f"{request.method} is not allowed on {request.url.path}; it supports {methods}"},
        status_code=status.HTTP_405_METHOD_NOT_ALLOWED,
        headers={"Allow": methods},
    )


def install_error_handlers(app: FastAPI) -> None:
    """Map validation errors, domain errors and anything unexpected to JSON ``{"detail": message}``.

    Examples
    --------
    >>> app = FastAPI(); install_error_handlers(app)
    """
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(status.HTTP_405_METHOD_NOT_ALLOWED, _method_not_allowed)
    app.add_exception_handler(DistbeliefError, _domain_error)
    app.add_exception_handler(Exception, _unexpected)


class BodyLimitMiddleware:
    """Refuse request bodies over a limit (413) before they are read whole.

    Dataset uploads (``POST /api/datasets``) may be up to ``upload_limit`` bytes, every other request up to
    ``limit``. A declared ``Content-Length`` over the limit is refused at once; a body streamed without one
    is counted as it arrives and refused as soon as it passes the limit, so nothing oversized is stored.

    Examples
    --------
    >>> app.add_middleware(BodyLimitMiddleware, limit=2**20, upload_limit=2**28)   # doctest: +SKIP
    """

    def __init__(self, app: ASGIApp, *, limit: int, upload_limit: int) -> None:
        self.app = app
        self.limit = limit
        self.upload_limit = upload_limit

    def _message(self, limit: int, upload: bool) -> str:
        what = "dataset uploads" if upload else "request bodies"
        setting = "DISTBELIEF_MAX_UPLOAD_BYTES" if upload else "DISTBELIEF_MAX_BODY_BYTES"
        return f"the request body is larger than the limit of {limit} bytes for {what}; send less ({setting})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and scope["path"].rstrip("/") == "/api/datasets"
        limit = self.upload_limit if upload else self.limit
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            response = JSONResponse(
                {"detail": self._message(limit, upload)},
                status_code=status.HTTP_413_CONTENT_TOO_LARGE,
                headers={"Connection": "close"},
            )
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, self._message(limit, upload))
            return message

        await self.app(scope, counted, send)
