"""The status read (``GET /api/jobs/{job_id}``) answered before the FastAPI stack, when that is safe.

Status reads are the hottest route: the dashboard and every waiting client poll them, and under load
(issue 18: 200 concurrent reads while 50 jobs are submitted and run) they queue behind each other in the
one event loop of the server. Through Starlette's and FastAPI's layers (error middlewares, routing over
every route, dependency resolution, the token check as a dependency) a read cost about twice what the answer
itself costs. :class:`StatusReadFastPath` answers the plain case directly: a GET of exactly that path,
without a query or a body, with the right bearer token (or none configured), of a job the runner knows. It
answers with the same body and headers the route would (:func:`job_body` is the route's encoder too).
Everything else -- another route, a missing or wrong token, an unknown job, the service starting, anything
unexpected -- goes on to the full stack, which answers as it always has (401, 404, 503, ...).
"""

from __future__ import annotations

from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from distbelief.api.schemas import JobPublic
from distbelief.api.settings import bearer_token, tokens_equal

__all__ = ["StatusReadFastPath", "job_body"]

_PREFIX = "/api/jobs/"
_JSON = (b"content-type", b"application/json")


def job_body(record: JobPublic) -> bytes:
    """A job record as the JSON body of a ``JobPublic``: the one encoding of the fast path and the route.

    Serialized by pydantic-core straight from the model, without the route's validation and re-encoding
    through the response model (which cost more than the rest of the read); a NaN is ``null``.

    Examples
    --------
    >>> job_body(record)[:8]   # doctest: +SKIP
    b'{"id":"3'
    """
    return record.model_dump_json().encode()


class StatusReadFastPath:
    """ASGI middleware: answer an authorized ``GET /api/jobs/{job_id}`` of a known job without the stack.

    Parameters
    ----------
    app : ASGIApp
        The rest of the application, which answers every request this one does not.
    state : starlette.datastructures.State
        The app's state: ``settings`` (the token) and ``runner`` (None while the service starts).

    Examples
    --------
    >>> front = StatusReadFastPath(app, state=app.state)   # doctest: +SKIP
    """

    def __init__(self, app: ASGIApp, *, state: State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = None
        if scope["type"] == "http" and scope["method"] == "GET":
            try:
                body = self._answer(scope)
            except Exception:  # whatever it is, the full stack deals with it (and logs it) as before
                body = None
        if body is None:
            await self.app(scope, receive, send)
            return
        headers = [(b"content-length", str(len(body)).encode()), _JSON]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _answer(self, scope: Scope) -> bytes | None:
        """The body of the answer, or None where the full stack must answer."""
        path: str = scope["path"]
        job_id = path[len(_PREFIX) :]
        if (
            not path.startswith(_PREFIX)
            or not job_id
            or "/" in job_id
            or scope.get("query_string")
            or scope.get("root_path")
        ):
            return None
        authorization = None
        for name, value in scope["headers"]:
            if name in (b"content-length", b"transfer-encoding") and value != b"0":
                return None  # a body: the stack's limits and errors apply
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")  # the first one counts, as in Starlette
        settings = self.state.settings
        if settings.api_token is not None:
            # As require_token reads it; anything else is the stack's 401.
            token = bearer_token(authorization)
            if token is None or not tokens_equal(token, settings.api_token):
                return None
        runner = getattr(self.state, "runner", None)
        if runner is None:
            return None
        record = runner.find(job_id)
        return None if record is None else job_body(record)
