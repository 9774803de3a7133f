"""FastAPI dependencies: the runner, the settings, and the bearer-token check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPBearer
from starlette.requests import HTTPConnection

from distbelief.api.runner import JobRunner
from distbelief.api.settings import Settings, bearer_token, tokens_equal

# The dependencies are async on purpose: a plain ``def`` dependency costs every request a trip through the
# thread pool, and under load (hundreds of concurrent status reads) that queue dominates the latency.

__all__ = ["RunnerDep", "SettingsDep", "get_runner", "get_settings", "require_token"]


class _Bearer(HTTPBearer):
    """The OpenAPI's bearer scheme, read by :func:`settings.bearer_token` (the fast path's parser too)."""

    async def __call__(self, request: HTTPConnection) -> str | None:  # type: ignore[override]
        return bearer_token(request.headers.get("authorization"))


_bearer = _Bearer(auto_error=False, description="The value of DISTBELIEF_API_TOKEN.")


async def get_settings(request: Request) -> Settings:
    """The app's settings.

    Examples
    --------
    >>> def route(settings: SettingsDep) -> int:   # doctest: +SKIP
    ...     return settings.max_concurrent_jobs
    """
    settings: Settings = request.app.state.settings
    return settings


async def get_runner(request: Request) -> JobRunner:
    """The app's job runner (created when the app starts).

    Examples
    --------
    >>> def route(runner: RunnerDep) -> int:   # doctest: +SKIP
    ...     return len(runner.running_ids())
    """
    runner: JobRunner | None = getattr(request.app.state, "runner", None)
    if runner is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the service is starting; retry in a moment")
    return runner


SettingsDep = Annotated[Settings, Depends(get_settings)]
RunnerDep = Annotated[JobRunner, Depends(get_runner)]


async def require_token(
    settings: SettingsDep,
    token: Annotated[str | None, Depends(_bearer)],
) -> None:
    """Let the request through if no token is configured or it carries the right one (constant time).

    Examples
    --------
    >>> router = APIRouter(dependencies=[Depends(require_token)])   # doctest: +SKIP
    """
    expected = settings.api_token
    if expected is None:
        return
    if token is None or not tokens_equal(token, expected):
        why = (
            "this route needs a bearer token: send the header 'Authorization: Bearer <DISTBELIEF_API_TOKEN>'"
            if token is None
            else "the bearer token is wrong; use the value of DISTBELIEF_API_TOKEN the server was started "
            "with"
        )
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, why, headers={"WWW-Authenticate": "Bearer"})
