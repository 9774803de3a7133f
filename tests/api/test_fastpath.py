"""The status-read fast path: the plain case answered before the stack, everything else passed on to it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from distributed import Client as DaskClient
from pydantic import SecretStr
from starlette.datastructures import State

from distbelief.api._fastpath import StatusReadFastPath
from distbelief.api._jobstore import JobStore
from distbelief.api.runner import JobRunner
from distbelief.api.schemas import JobPublic
from tests.api.conftest import LOGISTIC, TOKEN, running_app, settings_for

RECORD = JobPublic(
    id="0123456789abcdef",
    algorithm="sandblaster-lbfgs",
    model=LOGISTIC,
    dataset="tiny",
    options={"maxiter": 3},
    status="running",
    created_at="2026-01-01T00:00:00+00:00",
)


class _Runner:
    def __init__(self, *, broken: bool = False) -> None:
        self.broken = broken

    def find(self, job_id: str) -> JobPublic | None:
        if self.broken:
            raise RuntimeError("a bug")
        return RECORD.model_copy() if job_id == RECORD.id else None


class _Settings:
    def __init__(self, token: str | None) -> None:
        self.api_token = SecretStr(token) if token is not None else None


def _call(
    path: str,
    *,
    method: str = "GET",
    headers: list[tuple[bytes, bytes]] | None = None,
    token: str | None = TOKEN,
    runner: Any = "default",
    **scope: Any,
) -> tuple[bool, list[dict[str, Any]]]:
    """Send one request through the middleware: ``(whether the stack below was reached, what was sent)``."""
    state = State()
    state.settings = _Settings(token)
    state.runner = _Runner() if runner == "default" else runner
    reached = False

    async def below(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached
        reached = True

    sent: list[dict[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    auth = [(b"authorization", f"Bearer {TOKEN}".encode())]
    full = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": b"",
        "root_path": "",
        "headers": auth if headers is None else headers,
        **scope,
    }
    asyncio.run(StatusReadFastPath(below, state=state)(full, receive, send))
    return reached, sent


def test_a_plain_status_read_is_answered_with_the_record_and_the_stack_is_not_reached() -> None:
    reached, sent = _call(f"/api/jobs/{RECORD.id}")
    assert not reached
    start, body = sent
    assert start["status"] == 200
    assert dict(start["headers"]) == {
        b"content-length": str(len(body["body"])).encode(),
        b"content-type": b"application/json",
    }
    assert json.loads(body["body"]) == RECORD.model_dump()
    # The scheme is case-insensitive and the credentials may be padded, as FastAPI's HTTPBearer reads them.
    assert not _call(f"/api/jobs/{RECORD.id}", headers=[(b"authorization", f"bEaReR  {TOKEN} ".encode())])[0]
    # Without a token configured, any caller may read (as require_token lets them).
    assert not _call(f"/api/jobs/{RECORD.id}", headers=[], token=None)[0]


@pytest.mark.parametrize(
    ("why", "path", "kwargs"),
    [
        ("no token", "/api/jobs/{id}", {"headers": []}),
        ("wrong token", "/api/jobs/{id}", {"headers": [(b"authorization", b"Bearer not-the-token")]}),
        ("not bearer", "/api/jobs/{id}", {"headers": [(b"authorization", f"Basic {TOKEN}".encode())]}),
        ("bearer, no credentials", "/api/jobs/{id}", {"headers": [(b"authorization", b"Bearer ")]}),
        ("unknown job", "/api/jobs/ffffffffffffffff", {}),
        ("the service is starting", "/api/jobs/{id}", {"runner": None}),
        ("a bug below", "/api/jobs/{id}", {"runner": _Runner(broken=True)}),
        ("not a GET", "/api/jobs/{id}", {"method": "DELETE"}),
        ("a query", "/api/jobs/{id}", {"query_string": b"x=1"}),
        (
            "a body",
            "/api/jobs/{id}",
            {"headers": [*[(b"authorization", f"Bearer {TOKEN}".encode())], (b"content-length", b"3")]},
        ),
        ("a streamed body", "/api/jobs/{id}", {"headers": [(b"transfer-encoding", b"chunked")]}),
        ("behind a root path", "/api/jobs/{id}", {"root_path": "/prefix"}),
        ("another route", "/api/jobs/{id}/metrics", {}),
        ("a trailing slash", "/api/jobs/{id}/", {}),
        ("the list", "/api/jobs/", {}),
        ("not a job", "/api/datasets/{id}", {}),
    ],
)
def test_anything_but_the_plain_case_goes_to_the_stack(why: str, path: str, kwargs: dict[str, Any]) -> None:
    reached, sent = _call(path.format(id=RECORD.id), **kwargs)
    assert reached and not sent, why


@pytest.mark.anyio
async def test_the_fast_answer_is_the_stacks_answer(
    tmp_path: Path, client: DaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A finished job the app finds in its store at start: its record does not change while it is read.
    result = {"fun": 0.25, "stats": {"evaluations": 4}}
    record = RECORD.model_copy(update={"status": "succeeded", "result": result})
    JobStore(str(tmp_path / "store")).save_record(record)
    async with running_app(settings_for(tmp_path / "store"), client) as (_, http):
        # A query string (which the route ignores) sends the same read through the whole stack: the oracle.
        fast, full = [await http.get(f"/api/jobs/{RECORD.id}{q}") for q in ("", "?via=stack")]
        assert fast.status_code == full.status_code == 200
        assert fast.headers["content-type"] == full.headers["content-type"] == "application/json"
        assert fast.headers["content-length"] == full.headers["content-length"]
        assert fast.content == full.content and fast.json()["result"] == record.result
        unknown = await http.get("/api/jobs/ffffffffffffffff")
        assert unknown.status_code == 404 and "no job" in unknown.json()["detail"]
        anonymous = await http.get(f"/api/jobs/{RECORD.id}", headers={"Authorization": ""})
        assert anonymous.status_code == 401 and "Bearer" in anonymous.json()["detail"]
        # The app has the fast path in front: with the route's way to the record broken, only it answers.
        monkeypatch.setattr(JobRunner, "get", _broken)
        assert (await http.get(f"/api/jobs/{RECORD.id}")).content == fast.content
        assert (await http.get(f"/api/jobs/{RECORD.id}?via=stack")).status_code == 500


def _broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a bug")
