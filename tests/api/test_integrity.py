"""Issue 18: what concurrent, broken or interrupted requests must not do to the store or the server.

A dataset in use by a queued or running job cannot be deleted (409); of concurrent creators under one name
exactly one gets 201; a bad upload or URL is a 4xx that keeps the connection; what a killed server left
half-written is cleaned when it starts again.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import os
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from distributed import Client as DaskClient

from distbelief.api._jobstore import JobStore, SharedLock, json_safe
from distbelief.api.routes.jobs import job_json
from distbelief.api.runner import JobRunner
from distbelief.api.schemas import JobPublic, PartitionPublic, ReplicaPlacementPublic
from distbelief.storage import Dataset
from tests.api.conftest import (
    AUTH,
    LOGISTIC,
    digits_npz,
    npz_bytes,
    running_app,
    settings_for,
    tiny_xy,
    wait_final,
)

SOFTMAX = {"kind": "softmax", "n_features": 64, "n_classes": 10}


def _hidden(store: Path) -> list[str]:
    return sorted(p for p in os.listdir(store / "datasets") if p.startswith("."))


def _request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes, ctype: str) -> Any:
    conn.request(method, path, body=body, headers={**AUTH, "Content-Type": ctype})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"null")


def _multipart(fields: dict[str, str], file: tuple[str, bytes]) -> tuple[bytes, str]:
    boundary = "test-boundary-1234"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{file[0]}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode()
        + file[1]
        + b"\r\n"
    )
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_a_nul_byte_url_and_a_truncated_npz_are_422_and_the_connection_stays_open(server: str) -> None:
    url = urllib.parse.urlsplit(server)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    try:
        code, body = _request(
            conn,
            "POST",
            "/api/datasets",
            json.dumps({"name": "x", "url": "a\u0000b"}).encode(),
            "application/json",
        )
        assert code == 422, body
        assert "url" in body["detail"]
        whole = npz_bytes(*tiny_xy())
        form, ctype = _multipart({"name": "cut"}, ("cut.npz", whole[: len(whole) // 2]))
        code, body = _request(conn, "POST", "/api/datasets", form, ctype)
        assert code == 422, body
        assert "cannot read" in body["detail"] and ".npz" in body["detail"]
        sock = conn.sock
        # The same connection (no reconnect: the server kept it alive after both refusals) still serves.
        code, body = _request(conn, "GET", "/api/datasets/cut", b"", "application/json")
        assert conn.sock is sock
        assert code == 404, body
    finally:
        conn.close()


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays_open(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    # One route of each kind: async (run on the event loop) and sync (run in the thread pool).
    monkeypatch.setattr(JobRunner, "list_jobs", boom)
    monkeypatch.setattr(JobRunner, "metrics", boom)
    url = urllib.parse.urlsplit(server)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    try:
        code, body = _request(conn, "GET", "/api/jobs", b"", "application/json")
        sock = conn.sock
        assert code == 500 and body == {
            "detail": "internal error (RuntimeError); the server log has the details"
        }
        code, body = _request(conn, "GET", "/api/jobs/0123456789abcdef/metrics", b"", "application/json")
        assert code == 500 and "RuntimeError" in body["detail"]
        code, body = _request(conn, "GET", "/api/health", b"", "application/json")
        assert conn.sock is sock  # no reconnect: the server kept the connection after both errors
        assert code == 200 and body["status"] == "ok"
    finally:
        conn.close()


def test_a_job_record_is_served_with_every_field_and_a_nan_as_null() -> None:
    record = JobPublic(
        id="0123456789abcdef",
        algorithm="downpour-sgd",
        model=LOGISTIC,
        dataset="tiny",
        options={"l2": 0.5},
        status="succeeded",
        created_at="2026-01-01T00:00:00+00:00",
        latest={"step": 3.0, "objective": 0.25},
        result={"fun": float("nan"), "message": "ok", "stats": {"evaluations": 4}},
        placement=[ReplicaPlacementPublic(replica=0, partitions=[PartitionPublic(partition=0, steps=3)])],
    )
    response = job_json(record)
    assert response.media_type == "application/json"
    # The oracle: the record's fields as Python values, with JSON's null for the NaN that JSON lacks.
    body = json.loads(bytes(response.body))
    assert body == json_safe(record.model_dump()) and body["result"]["fun"] is None


@pytest.mark.anyio
async def test_a_unicode_digit_label_column_is_a_name_not_a_crash(asgi: httpx.AsyncClient) -> None:
    # Found by schemathesis: "¹".isdigit() is True but int("¹") raises, which was a 500.
    csv = b"a,b\n1,2\n3,4\n"
    r = await asgi.post(
        "/api/datasets", data={"name": "sup", "label_column": "\u00b9"}, files={"file": ("t.csv", csv)}
    )
    assert r.status_code == 422, r.text
    assert "\u00b9" in r.json()["detail"] or "label" in r.json()["detail"]


@pytest.mark.anyio
async def test_an_npy_upload_is_named_as_such(asgi: httpx.AsyncClient) -> None:
    buf = io.BytesIO()
    np.save(buf, np.eye(3))
    r = await asgi.post("/api/datasets", data={"name": "one"}, files={"file": ("one.npy", buf.getvalue())})
    assert r.status_code == 422, r.text
    assert "single .npy array" in r.json()["detail"]
    assert "CSV" not in r.json()["detail"].split(";")[0]


@pytest.mark.anyio
async def test_of_five_concurrent_uploads_under_one_name_exactly_one_is_created(
    tmp_path: Path, client: DaskClient
) -> None:
    X, y = tiny_xy(n=20_000, d=20)
    payload = npz_bytes(X, y)
    async with running_app(settings_for(tmp_path), client) as (_, http):
        for overwrite in ("false", "true"):
            name = f"same-{overwrite}"
            results = await asyncio.gather(
                *(
                    http.post(
                        "/api/datasets",
                        data={"name": name, "overwrite": overwrite},
                        files={"file": ("d.npz", payload)},
                    )
                    for _ in range(5)
                )
            )
            codes = sorted(r.status_code for r in results)
            if overwrite == "false":
                assert codes == [201, 409, 409, 409, 409], [r.text for r in results]
            else:  # each one either replaced the dataset or found another upload under way
                assert set(codes) <= {201, 409} and 201 in codes, [r.text for r in results]
            assert all(
                "exists already" in r.text or "uploading" in r.text for r in results if r.status_code == 409
            )
            got = (await http.get(f"/api/datasets/{name}")).json()
            assert got["n_rows"] == 20_000
        assert _hidden(tmp_path) == []  # nothing half-written left behind


@pytest.mark.anyio
async def test_a_dataset_in_use_cannot_be_deleted_and_submits_racing_deletes_stay_consistent(
    tmp_path: Path, client: DaskClient
) -> None:
    async with running_app(settings_for(tmp_path, max_concurrent_jobs=1), client) as (_, http):
        # A job that runs until it is cancelled holds 'digits'; every other job waits in the queue.
        r = await http.post("/api/datasets", data={"name": "digits"}, files={"file": ("d.npz", digits_npz())})
        assert r.status_code == 201, r.text
        blocker = await http.post(
            "/api/jobs",
            json={
                # Gradient descent with no tolerance: L-BFGS with maxiter alone once converged on digits
                # (succeeded) before the races below were over, on a slow CI box.
                "algorithm": "sandblaster-gd",
                "dataset": "digits",
                "model": SOFTMAX,
                "options": {"gtol": 0.0, "ftol": 0.0, "maxiter": 10**5},
            },
        )
        assert blocker.status_code == 201, blocker.text
        r = await http.delete("/api/datasets/digits")
        assert r.status_code == 409 and blocker.json()["id"] in r.json()["detail"], r.text

        X, y = tiny_xy()
        accepted: list[str] = []
        for i in range(6):
            name = f"race{i}"
            r = await http.post(
                "/api/datasets", data={"name": name}, files={"file": ("t.npz", npz_bytes(X, y))}
            )
            assert r.status_code == 201, r.text
            job = {
                "algorithm": "sandblaster-gd",
                "dataset": name,
                "model": LOGISTIC,
                "options": {"maxiter": 2},
            }
            submit, delete = await asyncio.gather(
                http.post("/api/jobs", json=job), http.delete(f"/api/datasets/{name}")
            )
            if submit.status_code == 201:
                # The job won: the dataset stays until it has run (the job is queued behind the blocker).
                assert delete.status_code == 409, delete.text
                accepted.append(submit.json()["id"])
                assert (await http.get(f"/api/datasets/{name}")).status_code == 200
            else:
                # The delete won: the job is refused, nothing about it is stored.
                assert delete.status_code == 204, delete.text
                assert submit.status_code == 422 and "no dataset" in submit.json()["detail"], submit.text
        r = await http.post(f"/api/jobs/{blocker.json()['id']}/cancel")
        assert r.status_code == 200, r.text
        for job_id in accepted:
            record = await wait_final(http, job_id)
            assert record["status"] == "succeeded", record["message"]
        jobs = (await http.get("/api/jobs", params={"limit": 100})).json()
        assert jobs["count"] == 1 + len(accepted)


@pytest.mark.anyio
async def test_leftovers_of_interrupted_writes_are_cleaned_on_start(
    tmp_path: Path, client: DaskClient
) -> None:
    store = JobStore(str(tmp_path))
    X, y = tiny_xy()
    # What a server killed mid-upload leaves: a complete or half-written copy under a hidden name.
    Dataset.from_arrays(X, y, path=store.staging_url("killed"))
    half = Path(store.staging_url("half"))
    (half / "X").mkdir(parents=True)
    (half / "X" / "zarr.json").write_text("{")
    # Killed while replacing 'kept': the old copy was set aside, the new one not yet in place.
    Dataset.from_arrays(X, y, path=str(tmp_path / "datasets" / ".kept.old-0123abcd"))
    # Killed mid-delete of a job, and mid-write of a job record.
    (tmp_path / "jobs" / ".0123456789abcdef.del-89abcdef").mkdir()
    (tmp_path / "jobs" / "fedcba9876543210").mkdir()
    (tmp_path / "jobs" / "fedcba9876543210" / "job.json.tmp-0123abcd").write_text("{")
    assert len(_hidden(tmp_path)) == 3

    async with running_app(settings_for(tmp_path), client) as (_, http):
        names = [d["name"] for d in (await http.get("/api/datasets")).json()["data"]]
        assert names == ["kept"]
        assert _hidden(tmp_path) == []
        assert sorted(os.listdir(tmp_path / "jobs")) == ["fedcba9876543210"]
        assert os.listdir(tmp_path / "jobs" / "fedcba9876543210") == []
        # The names are free again.
        r = await http.post(
            "/api/datasets", data={"name": "killed"}, files={"file": ("t.npz", npz_bytes(X, y))}
        )
        assert r.status_code == 201, r.text


@pytest.mark.anyio
async def test_sixty_thousand_unknown_options_get_a_small_422(asgi: httpx.AsyncClient) -> None:
    options = {f"k{i}": 1 for i in range(60_000)}
    body = {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC, "options": options}
    raw = json.dumps(body).encode()
    assert 600_000 < len(raw) < 1_000_000
    r = await asgi.post("/api/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    assert len(r.content) < 8_000, len(r.content)
    assert "'k0'" in r.json()["detail"] and "59990 more" in r.json()["detail"]
    assert isinstance(r.json()["errors"], list)
    assert (await asgi.get("/api/jobs")).json()["count"] == 0


@pytest.mark.anyio
async def test_a_form_with_unknown_fields_is_422_naming_them(asgi: httpx.AsyncClient) -> None:
    X, y = tiny_xy()
    fields = {"name": "f", **{f"extra{i}": "1" for i in range(8)}}
    r = await asgi.post("/api/datasets", data=fields, files={"file": ("t.npz", npz_bytes(X, y))})
    assert r.status_code == 422, r.text
    assert "'extra0'" in r.json()["detail"] and "label_column" in r.json()["detail"]
    fields = {"name": "f", **{f"extra{i}": "1" for i in range(40)}}
    r = await asgi.post("/api/datasets", data=fields, files={"file": ("t.npz", npz_bytes(X, y))})
    assert r.status_code == 400, r.text
    assert (await asgi.get("/api/datasets/f")).status_code == 404


def test_the_datasets_lock_lets_submissions_share_it_and_a_delete_wait_for_them() -> None:
    lock = SharedLock()
    order: list[str] = []
    with lock.shared():
        both = threading.Event()

        def second_reader() -> None:
            with lock.shared():  # does not wait for the first reader
                both.set()

        reader = threading.Thread(target=second_reader)
        reader.start()
        assert both.wait(5)
        reader.join()

        def writer() -> None:
            with lock.exclusive():
                order.append("exclusive")

        thread = threading.Thread(target=writer)
        thread.start()
        time.sleep(0.2)
        order.append("shared released")  # the writer is still waiting for this reader
    thread.join(5)
    assert order == ["shared released", "exclusive"]
