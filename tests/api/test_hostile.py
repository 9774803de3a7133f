"""Hostile clients and broken stores (issue 27): each gets a clear 4xx or is shut out, never a 500, and the
stored state and running jobs are left alone."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from distributed import Client as DaskClient

from distbelief.storage import Dataset
from tests.api.conftest import (
    LOGISTIC,
    npz_bytes,
    running_app,
    settings_for,
    tiny_xy,
    upload_digits,
    wait_final,
    wait_iterations,
)

pytestmark = pytest.mark.anyio

LIMIT = 2 * 2**20  # the digits fit (0.9 MB)


@pytest.fixture
async def small(tmp_path: Path, client: DaskClient) -> AsyncIterator[httpx.AsyncClient]:
    """An app whose uploads may hold at most ``LIMIT`` bytes, with the dataset ``tiny``; its store is
    ``tmp_path / "store"`` (see :func:`_store_of`)."""
    async with running_app(settings_for(tmp_path / "store", max_upload_bytes=LIMIT), client) as (_, http):
        _STORES[id(http)] = tmp_path / "store"
        r = await http.post(
            "/api/datasets", data={"name": "tiny"}, files={"file": ("t.npz", npz_bytes(*tiny_xy()))}
        )
        assert r.status_code == 201, r.text
        yield http


_STORES: dict[int, Path] = {}


def _store_of(http: httpx.AsyncClient) -> Path:
    return _STORES[id(http)]


def _npz_with_header(shape: tuple[int, ...]) -> bytes:
    """An .npz whose ``X`` header claims ``shape`` (float64) but holds no data."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": shape})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("X.npy", header.getvalue())
        archive.writestr("y.npy", _npy(np.zeros(10)))
    return buf.getvalue()


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


async def _names(http: httpx.AsyncClient) -> list[str]:
    return [d["name"] for d in (await http.get("/api/datasets")).json()["data"]]


async def test_a_zip_bomb_is_refused_by_its_decompressed_size(small: httpx.AsyncClient) -> None:
    # 8 MB of zeros deflate to ~8 kB: under the body limit, 4 times over the limit once decompressed.
    buf = io.BytesIO()
    np.savez_compressed(buf, X=np.zeros((1000, 1000)), y=np.zeros(1000))
    assert len(buf.getvalue()) < LIMIT // 4
    r = await small.post("/api/datasets", data={"name": "bomb"}, files={"file": ("b.npz", buf.getvalue())})
    assert r.status_code == 413, r.text
    assert str(LIMIT) in r.json()["detail"] and "DISTBELIEF_MAX_UPLOAD_BYTES" in r.json()["detail"]
    assert await _names(small) == ["tiny"]


@pytest.mark.parametrize("shape", [(10**12, 10), (2**62, 2**62), (1000, 1000)])
async def test_an_npz_header_that_claims_a_huge_shape_is_a_413(
    small: httpx.AsyncClient, shape: tuple[int, ...]
) -> None:
    r = await small.post(
        "/api/datasets", data={"name": "huge"}, files={"file": ("h.npz", _npz_with_header(shape))}
    )
    assert r.status_code == 413, r.text
    assert str(LIMIT) in r.json()["detail"]
    assert await _names(small) == ["tiny"]


async def test_an_npz_just_under_the_limit_is_accepted(small: httpx.AsyncClient) -> None:
    X = np.zeros((LIMIT // 88 - 10, 10))  # X and y: 11 float64 a row
    X[:, 0] = np.arange(len(X))
    y = (np.arange(len(X)) % 2).astype(float)
    buf = io.BytesIO()
    np.savez_compressed(buf, X=X, y=y)
    r = await small.post("/api/datasets", data={"name": "fits"}, files={"file": ("f.npz", buf.getvalue())})
    assert r.status_code == 201, r.text


SOFTMAX = {"kind": "softmax", "n_features": 64, "n_classes": 10}
# Runs until it is cancelled: no convergence test can end it.
ENDLESS = {"gtol": 0.0, "ftol": 0.0, "maxiter": 100_000, "l2": 1e-3}


async def test_an_alias_does_not_free_its_dataset_while_a_job_reads_it(small: httpx.AsyncClient) -> None:
    await upload_digits(small)
    digits = _store_of(small) / "datasets" / "digits"
    r = await small.post("/api/datasets", json={"name": "alias", "url": str(digits)})
    assert r.status_code == 201, r.text
    body = {"algorithm": "sandblaster-lbfgs", "dataset": "alias", "model": SOFTMAX, "options": ENDLESS}
    job = (await small.post("/api/jobs", json=body)).json()
    try:
        await wait_iterations(small, job["id"], 1)
        r = await small.delete("/api/datasets/digits")
        assert r.status_code == 409 and job["id"] in r.json()["detail"], r.text
        assert "POST /api/jobs/{id}/cancel" in r.json()["detail"], r.text  # not "{{id}}"
        r = await small.post(
            "/api/datasets",
            data={"name": "digits", "overwrite": "true"},
            files={"file": ("d.npz", npz_bytes(*tiny_xy()))},
        )
        assert r.status_code == 409 and job["id"] in r.json()["detail"], r.text
        assert (await small.get("/api/datasets/digits")).json()["n_rows"] == 1797
    finally:
        await small.post(f"/api/jobs/{job['id']}/cancel")
        assert (await wait_final(small, job["id"]))["status"] == "cancelled"
    assert (await small.delete("/api/datasets/digits")).status_code == 204


async def test_a_dangling_alias_answers_404_and_409_and_can_be_forgotten(small: httpx.AsyncClient) -> None:
    target = _store_of(small) / "imports" / "gone"
    Dataset.from_arrays(*tiny_xy(), path=target)
    r = await small.post("/api/datasets", json={"name": "dangling", "url": str(target)})
    assert r.status_code == 201, r.text
    assert r.json()["url"] == "imports/gone"  # no absolute path of the server
    shutil.rmtree(target)
    r = await small.get("/api/datasets/dangling")
    assert r.status_code == 404 and "holds no dataset any more" in r.json()["detail"], r.text
    assert str(target) not in r.text
    r = await small.post(
        "/api/jobs", json={"algorithm": "sandblaster-lbfgs", "dataset": "dangling", "model": LOGISTIC}
    )
    assert r.status_code == 409 and "DELETE /api/datasets/dangling" in r.json()["detail"], r.text
    assert (await small.get("/api/jobs")).json()["count"] == 0
    assert await _names(small) == ["tiny"]
    assert (await small.delete("/api/datasets/dangling")).status_code == 204
    assert (await small.get("/api/datasets/dangling")).status_code == 404


async def test_a_dataset_removed_behind_the_service_is_gone(small: httpx.AsyncClient) -> None:
    body = {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC, "options": {"maxiter": 2}}
    assert (await small.get("/api/datasets/tiny")).status_code == 200  # opened (and kept) once
    shutil.rmtree(_store_of(small) / "datasets" / "tiny")
    r = await small.get("/api/datasets/tiny")
    assert r.status_code == 404, r.text
    r = await small.post("/api/jobs", json=body)
    assert r.status_code in (404, 422) and "no dataset named 'tiny'" in r.json()["detail"], r.text
    assert (await small.get("/api/jobs")).json()["count"] == 0
    assert await _names(small) == []


async def test_corrupt_job_records_are_set_aside_and_the_service_starts(
    tmp_path: Path, client: DaskClient, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings_for(tmp_path / "store")
    body = {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC, "options": {"maxiter": 2}}
    async with running_app(settings, client) as (_, http):
        await http.post(
            "/api/datasets", data={"name": "tiny"}, files={"file": ("t.npz", npz_bytes(*tiny_xy()))}
        )
        good = (await http.post("/api/jobs", json=body)).json()
        await wait_final(http, good["id"])
    jobs = tmp_path / "store" / "jobs"
    record = json.loads((jobs / good["id"] / "job.json").read_text())
    broken = {
        "0000000000000001": json.dumps(
            {k: v for k, v in {**record, "id": "0000000000000001"}.items() if k != "algorithm"}
        ),
        "0000000000000002": json.dumps(
            {k: v for k, v in {**record, "id": "0000000000000002"}.items() if k != "created_at"}
        ),
        "0000000000000003": json.dumps({**record, "id": "0000000000000003"})[:50],  # torn
    }
    for job_id, text in broken.items():
        (jobs / job_id).mkdir()
        (jobs / job_id / "job.json").write_text(text)
    with caplog.at_level("WARNING", logger="distbelief.api"):
        async with running_app(settings, client) as (_, http):
            listed = await http.get("/api/jobs")
            assert listed.status_code == 200 and [j["id"] for j in listed.json()["data"]] == [good["id"]]
            for job_id in broken:
                assert f"job {job_id} was set aside" in caplog.text
                r = await http.get(f"/api/jobs/{job_id}")
                assert r.status_code == 404 and "set aside" in r.json()["detail"], r.text
                assert (await http.delete(f"/api/jobs/{job_id}")).status_code == 204
                assert "set aside" not in (await http.get(f"/api/jobs/{job_id}")).json()["detail"]
            assert sorted(p.name for p in jobs.iterdir()) == [good["id"]]
            r = await http.get(f"/api/jobs/{good['id']}/params")
            assert r.status_code == 200, r.text


@pytest.mark.parametrize("scheme", ["s3", "gs", "gcs", "abfs", "az"])
async def test_a_url_scheme_without_its_backend_is_a_422_naming_the_package(
    small: httpx.AsyncClient, scheme: str
) -> None:
    import importlib.util

    package = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "az": "adlfs"}[scheme]
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    r = await small.post("/api/datasets", json={"name": "remote", "url": f"{scheme}://bucket/data"})
    assert r.status_code == 422 and package in r.json()["detail"], r.text
    assert await _names(small) == ["tiny"]


async def test_a_huge_integer_is_a_422(small: httpx.AsyncClient) -> None:
    for model in (
        {"kind": "logistic", "n_features": int("9" * 400)},
        {"kind": "mlp", "layer_sizes": [4, int("9" * 400), 2]},
    ):
        body: dict[str, Any] = {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": model}
        r = await small.post("/api/jobs", json=body)
        assert r.status_code == 422, r.text
    body = {
        "algorithm": "sandblaster-lbfgs",
        "dataset": "tiny",
        "model": LOGISTIC,
        "options": {"maxiter": int("9" * 400)},
    }
    r = await small.post("/api/jobs", json=body)
    assert r.status_code == 422, r.text
    assert (await small.get("/api/jobs")).json()["count"] == 0


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/api/jobs", {"GET", "POST"}),
        ("PATCH", "/api/jobs/abc", {"GET", "DELETE"}),
        ("DELETE", "/api/datasets", {"GET", "POST"}),
        ("POST", "/api/datasets/tiny", {"GET", "DELETE"}),
        ("GET", "/api/jobs/abc/cancel", {"POST"}),
        ("POST", "/api/health", {"GET"}),
    ],
)
async def test_every_405_says_what_is_allowed(
    small: httpx.AsyncClient, method: str, path: str, allowed: set[str]
) -> None:
    r = await small.request(method, path)
    assert r.status_code == 405, r.text
    given = {m.strip() for m in r.headers["Allow"].split(",")} - {"HEAD"}
    assert given == allowed, r.headers


async def test_no_response_shows_an_absolute_path_of_the_server(tmp_path: Path, client: DaskClient) -> None:
    store = tmp_path / "store"
    body = {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC, "options": {"maxiter": 2}}
    async with running_app(settings_for(store), client) as (_, http):
        await http.post(
            "/api/datasets", data={"name": "tiny"}, files={"file": ("t.npz", npz_bytes(*tiny_xy()))}
        )
        job = (await http.post("/api/jobs", json=body)).json()
        await wait_final(http, job["id"])
        # Metrics that cannot be read: a 500 whose message names the file, relative to the store.
        metrics = store / "jobs" / job["id"] / "metrics.zarr"
        for _ in range(200):  # written just after the job's status says it has ended
            if metrics.exists():
                break
            await anyio.sleep(0.05)
        shutil.rmtree(metrics)
        metrics.mkdir()
        (metrics / "zarr.json").write_text("{torn")
        r = await http.get(f"/api/jobs/{job['id']}/metrics")
        assert r.status_code == 500, r.text
        assert str(tmp_path) not in r.text and "<store>" in r.json()["detail"], r.text
        # Registered inside the store: shown relative to it; refused outside it: no resolved path either.
        inside = store / "imports" / "copy"
        Dataset.from_arrays(*tiny_xy(), path=inside)
        r = await http.post("/api/datasets", json={"name": "copy", "url": str(inside)})
        assert r.status_code == 201 and r.json()["url"] == "imports/copy", r.text
        for response in (await http.get("/api/datasets"), await http.get("/api/datasets/copy")):
            assert str(tmp_path) not in response.text, response.text
        r = await http.post("/api/datasets", json={"name": "empty", "url": str(store / "imports")})
        assert r.status_code == 422 and str(tmp_path) not in r.text.replace(str(store / "imports"), ""), (
            r.text
        )
