"""Fixtures of the service tests: the real app (httpx ASGITransport) and a real uvicorn server on 127.0.0.1.

Every app runs its jobs on the session's multi-process LocalCluster (``client`` in tests/conftest.py), so no
test starts a cluster of its own. Every server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import scipy.optimize
from distributed import Client as DaskClient
from fastapi import FastAPI

from distbelief import models
from distbelief.api import BackgroundServer, Client, Settings, create_app
from distbelief.storage import load_digits

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FINAL = ("succeeded", "failed", "cancelled")
LOGISTIC: dict[str, Any] = {"kind": "logistic", "n_features": 4}


def tiny_xy(n: int = 240, d: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A small binary problem: jobs on it take a fraction of a second."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w = rng.normal(size=d)
    y = (X @ w + 0.5 * rng.normal(size=n) > 0).astype(float)
    return X, y


def npz_bytes(X: Any, y: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, X=np.asarray(X), y=np.asarray(y))
    return buf.getvalue()


@functools.cache
def digits_npz() -> bytes:
    return npz_bytes(*load_digits())


async def upload_digits(http: httpx.AsyncClient) -> None:
    """Upload the handwritten digits as ``digits``: a problem L-BFGS takes hundreds of iterations to solve
    to machine precision, so jobs on it run until they are stopped."""
    r = await http.post("/api/datasets", data={"name": "digits"}, files={"file": ("d.npz", digits_npz())})
    assert r.status_code == 201, r.text


def scipy_logistic(X: np.ndarray, y: np.ndarray, l2: float) -> Any:
    """The oracle: SciPy's L-BFGS-B on the same objective, in one process."""
    model = models.Logistic(X.shape[1])
    return scipy.optimize.minimize(
        lambda w: models.objective(model, w, X, y, l2=l2),
        np.zeros(model.n_params),
        jac=True,
        method="L-BFGS-B",
        options={"gtol": 1e-10, "ftol": 1e-14, "maxiter": 1000},
    )


def settings_for(store: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "store": str(store),
        "api_token": TOKEN,
        "metrics_flush_seconds": 0.2,
        "checkpoint_every": 0,
    }
    values.update(overrides)
    return Settings(**values)


@contextlib.asynccontextmanager
async def running_app(
    settings: Settings, dask_client: DaskClient
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The real app with its lifespan (runner started and stopped), reached through httpx's ASGITransport."""
    app = create_app(settings, client=dask_client)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://testserver", headers=AUTH, timeout=120
        ) as http,
    ):
        yield app, http


async def wait_final(http: httpx.AsyncClient, job_id: str, timeout: float = 90.0) -> dict[str, Any]:
    import anyio

    deadline = time.monotonic() + timeout
    while True:
        record: dict[str, Any] = (await http.get(f"/api/jobs/{job_id}")).json()
        if record["status"] in FINAL:
            return record
        assert time.monotonic() < deadline, f"job {job_id} still {record['status']} after {timeout} s"
        await anyio.sleep(0.05)


async def wait_iterations(
    http: httpx.AsyncClient, job_id: str, n: int, timeout: float = 90.0
) -> dict[str, Any]:
    """Wait until a job has done ``n`` iterations; fail at once if it ends before."""
    import anyio

    deadline = time.monotonic() + timeout
    while True:
        record: dict[str, Any] = (await http.get(f"/api/jobs/{job_id}")).json()
        if record["iterations"] >= n:
            return record
        assert record["status"] not in FINAL, (
            f"job {job_id} ended early: {record['status']}: {record['message']}"
        )
        assert time.monotonic() < deadline, (
            f"job {job_id} did {record['iterations']} iterations in {timeout} s"
        )
        await anyio.sleep(0.05)


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_chromium() -> str:
    """The path of Debian's chromium, or skip the test with a reason (fail it where
    ``DISTBELIEF_REQUIRE_BROWSER=1``: CI installs the browser and sets it, so a browser test cannot silently
    skip there)."""
    if not Path(CHROMIUM).exists():
        message = "Debian's chromium is missing: apt-get install -y chromium (.ci/run does)"
        if os.environ.get("DISTBELIEF_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return CHROMIUM


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def asgi(tmp_path: Path, client: DaskClient) -> AsyncIterator[httpx.AsyncClient]:
    """An authorized httpx client of a fresh app (own store) holding the dataset ``tiny``."""
    async with running_app(settings_for(tmp_path / "store"), client) as (_, http):
        X, y = tiny_xy()
        r = await http.post(
            "/api/datasets", data={"name": "tiny"}, files={"file": ("tiny.npz", npz_bytes(X, y))}
        )
        assert r.status_code == 201, r.text
        yield http


@contextlib.contextmanager
def live_server(store: Path, dask_client: DaskClient, **overrides: Any) -> Iterator[str]:
    """A real uvicorn server on 127.0.0.1 (a free port) serving the app; yields its URL."""
    app = create_app(settings_for(store, **overrides), client=dask_client)
    with BackgroundServer(app, host="127.0.0.1", port=0) as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, session_client: DaskClient) -> Iterator[str]:
    """One real server per test module, with the dataset ``tiny`` uploaded."""
    session_client.wait_for_workers(2, timeout=60)
    with live_server(tmp_path_factory.mktemp("server-store"), session_client) as url:
        with Client(url, TOKEN) as api:
            api.upload_dataset("tiny", *tiny_xy())
        yield url


async def upload_datasets(http: httpx.AsyncClient, datasets: dict[str, tuple[Any, Any]]) -> None:
    """POST each ``name: (X, y)`` to /api/datasets as an .npz upload."""
    for name, (X, y) in datasets.items():
        r = await http.post("/api/datasets", data={"name": name}, files={"file": ("d.npz", npz_bytes(X, y))})
        assert r.status_code == 201, r.text
