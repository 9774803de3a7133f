"""The REST API through the real app (httpx ASGITransport): jobs end to end, events, cancel, datasets."""

from __future__ import annotations

import csv
import io
import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from distributed import Client as DaskClient

from distbelief import models
from distbelief.storage import Dataset, worker_addresses
from tests.api.conftest import (
    LOGISTIC,
    TOKEN,
    npz_bytes,
    running_app,
    scipy_logistic,
    settings_for,
    tiny_xy,
    upload_digits,
    wait_final,
    wait_iterations,
)

pytestmark = pytest.mark.anyio

LBFGS = {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC}
# A job that runs until it is stopped: no convergence test can end it for hundreds of iterations.
ENDLESS: dict[str, Any] = {
    "algorithm": "sandblaster-lbfgs",
    "dataset": "digits",
    "model": {"kind": "softmax", "n_features": 64, "n_classes": 10},
    "options": {"gtol": 0.0, "ftol": 0.0, "maxiter": 100_000, "maxfev": 100_000},
}


async def test_lbfgs_job_matches_scipy_and_serves_its_results(asgi: httpx.AsyncClient) -> None:
    l2 = 1e-2
    r = await asgi.post(
        "/api/jobs", json={**LBFGS, "eval_dataset": "tiny", "options": {"l2": l2, "gtol": 1e-9}}
    )
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] in ("queued", "running") and job["options"]["l2"] == l2
    record = await wait_final(asgi, job["id"])
    assert record["status"] == "succeeded", record["message"]

    X, y = tiny_xy()
    ref = scipy_logistic(X, y, l2)
    result = record["result"]
    assert result["fun"] == pytest.approx(ref.fun, rel=1e-8)
    assert result["eval_accuracy"] == pytest.approx(
        float(np.mean(models.Logistic(4).predict(np.asarray(ref.x), X) == y)), abs=1e-2
    )

    params = np.load(
        io.BytesIO((await asgi.get(f"/api/jobs/{job['id']}/params")).content), allow_pickle=False
    )
    np.testing.assert_allclose(params, ref.x, rtol=1e-4, atol=1e-6)
    f, _ = models.objective(models.Logistic(4), params, X, y, l2=l2)
    assert f == pytest.approx(result["fun"], rel=1e-12)

    metrics = (await asgi.get(f"/api/jobs/{job['id']}/metrics")).json()
    assert metrics["dim"] == "iteration"
    cols = metrics["columns"]
    assert cols["iteration"] == list(range(result["nit"] + 1))
    assert cols["objective"][-1] == pytest.approx(result["fun"], rel=1e-12)
    assert all(a >= b for a, b in zip(cols["objective"], cols["objective"][1:], strict=False))

    text = (await asgi.get(f"/api/jobs/{job['id']}/metrics", params={"format": "csv"})).text
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == list(cols)
    assert [float(v) for v in (r[rows[0].index("objective")] for r in rows[1:])] == cols["objective"]


async def test_events_stream_every_metrics_row_and_the_status_changes(asgi: httpx.AsyncClient) -> None:
    await upload_digits(asgi)
    job = (
        await asgi.post("/api/jobs", json={**ENDLESS, "options": {**ENDLESS["options"], "maxiter": 12}})
    ).json()
    # ASGITransport hands the body over once the stream has ended, that is when the job has finished.
    body = (await asgi.get(f"/api/jobs/{job['id']}/events")).text
    events = []
    for frame in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":"))
        events.append((lines["event"], json.loads(lines["data"])))
    names = [e for e, _ in events]
    assert names[-1] == "end" and events[-1][1]["status"] == "succeeded"
    statuses = [d["status"] for e, d in events if e == "status"]
    assert statuses[-1] == "succeeded" and len(statuses) == len(set(statuses))
    rows: list[list[float]] = []
    for e, d in events:
        if e == "metrics":
            rows = list(d["rows"]) if d["reset"] else rows + d["rows"]
    served = (await asgi.get(f"/api/jobs/{job['id']}/metrics")).json()["columns"]
    assert [r[0] for r in rows] == served["iteration"] == list(range(13))
    assert [r[1] for r in rows] == served["objective"]


async def test_cancel_stops_a_running_job_and_keeps_its_parameters(asgi: httpx.AsyncClient) -> None:
    await upload_digits(asgi)
    job = (await asgi.post("/api/jobs", json=ENDLESS)).json()
    await wait_iterations(asgi, job["id"], 3)
    assert (await asgi.delete(f"/api/jobs/{job['id']}")).status_code == 409  # running: cancel first
    r = await asgi.post(f"/api/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["cancel_requested"]
    record = await wait_final(asgi, job["id"])
    assert record["status"] == "cancelled" and record["iterations"] >= 3
    assert np.load(io.BytesIO((await asgi.get(f"/api/jobs/{job['id']}/params")).content)).shape == (650,)
    again = await asgi.post(f"/api/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and "already" in again.json()["detail"]
    assert (await asgi.delete(f"/api/jobs/{job['id']}")).status_code == 204
    gone = await asgi.get(f"/api/jobs/{job['id']}")
    assert gone.status_code == 404 and "no job" in gone.json()["detail"]


async def test_queue_runs_at_most_the_limit_and_cancels_queued_jobs(
    tmp_path: Path, client: DaskClient
) -> None:
    async with running_app(settings_for(tmp_path, max_concurrent_jobs=1), client) as (app, http):
        X, y = tiny_xy()
        await http.post("/api/datasets", data={"name": "tiny"}, files={"file": ("t.npz", npz_bytes(X, y))})
        await upload_digits(http)
        first = (await http.post("/api/jobs", json=ENDLESS)).json()
        second = (await http.post("/api/jobs", json={**LBFGS, "options": {"maxiter": 3}})).json()
        third = (await http.post("/api/jobs", json={**LBFGS, "options": {"maxiter": 3}})).json()
        import anyio

        for _ in range(100):
            if (await http.get(f"/api/jobs/{first['id']}")).json()["status"] == "running":
                break
            await anyio.sleep(0.05)
        listed = (await http.get("/api/jobs", params={"status": "queued"})).json()
        assert {j["id"] for j in listed["data"]} == {second["id"], third["id"]} and listed["count"] == 2
        assert app.state.runner.running_ids() == [first["id"]]
        assert (await http.get("/api/cluster")).json()["queued_jobs"] == 2
        cancelled = (await http.post(f"/api/jobs/{third['id']}/cancel")).json()
        assert cancelled["status"] == "cancelled" and cancelled["message"] == "cancelled while queued"
        await http.post(f"/api/jobs/{first['id']}/cancel")
        assert (await wait_final(http, second["id"]))["status"] == "succeeded"
        assert (await wait_final(http, first["id"]))["status"] == "cancelled"
        third_now = (await http.get(f"/api/jobs/{third['id']}")).json()
        assert third_now["status"] == "cancelled" and third_now["started_at"] is None
        page = (await http.get("/api/jobs", params={"limit": 2, "offset": 1})).json()
        assert page["count"] == 3 and [j["id"] for j in page["data"]] == [second["id"], first["id"]]


async def test_models_catalogue_is_the_spec_schemas(asgi: httpx.AsyncClient) -> None:
    body = (await asgi.get("/api/models")).json()
    assert [m["kind"] for m in body["data"]] == list(models.MODEL_KINDS)
    for m in body["data"]:
        assert m["schema"] == models.spec_schema(m["kind"])


async def test_cluster_shows_the_workers_and_the_actors_of_a_running_job(
    asgi: httpx.AsyncClient, client: DaskClient
) -> None:
    await upload_digits(asgi)
    job = (
        await asgi.post("/api/jobs", json={**ENDLESS, "options": {**ENDLESS["options"], "replicas": 2}})
    ).json()
    import anyio

    mine: list[dict[str, str]] = []
    for _ in range(200):
        cluster = (await asgi.get("/api/cluster")).json()
        mine = [a for a in cluster["actors"] if a["job_id"] == job["id"]]
        if len(mine) == 3 and cluster["running_jobs"] == [job["id"]]:
            break
        await anyio.sleep(0.05)
    assert sorted(a["kind"] for a in mine) == ["replica", "replica", "shard"]
    workers = worker_addresses(client)
    assert [w["address"] for w in cluster["workers"]] == workers
    assert {a["worker"] for a in mine} <= set(workers)
    await asgi.post(f"/api/jobs/{job['id']}/cancel")
    await wait_final(asgi, job["id"])


async def test_datasets_upload_csv_register_list_and_delete(asgi: httpx.AsyncClient, tmp_path: Path) -> None:
    text = "a,b,label\n1,2,0\n3,4,1\n5,6,2\n7,8,1\n"
    r = await asgi.post(
        "/api/datasets",
        data={"name": "small-csv", "label_column": "label"},
        files={"file": ("s.csv", text.encode())},
    )
    assert r.status_code == 201, r.text
    assert (r.json()["n_rows"], r.json()["n_features"], r.json()["n_classes"]) == (4, 2, 3)

    # A dataset already inside the store can be registered under a second name; nothing outside can.
    inside = tmp_path / "store" / "imports" / "extra"
    Dataset.from_arrays(np.eye(3), [0.0, 1.0, 1.0], path=inside)
    r = await asgi.post("/api/datasets", json={"name": "extra", "url": str(inside)})
    assert r.status_code == 201 and r.json()["source"] == "registered"
    outside = tmp_path / "elsewhere"
    Dataset.from_arrays(np.eye(3), [0.0, 1.0, 1.0], path=outside)
    for url in (
        str(outside),
        f"file://{outside}",
        "store/../../elsewhere",
        "memory://x",
        "http://127.0.0.1/x",
    ):
        r = await asgi.post("/api/datasets", json={"name": "outside", "url": url})
        assert r.status_code == 422 and "upload the data instead" in r.json()["detail"], url

    listed = (await asgi.get("/api/datasets")).json()
    assert sorted(d["name"] for d in listed["data"]) == ["extra", "small-csv", "tiny"]
    assert (await asgi.get("/api/datasets/tiny")).json()["n_rows"] == 240
    assert (await asgi.delete("/api/datasets/extra")).status_code == 204
    assert Dataset.exists(inside)  # forgetting a registered dataset never deletes its data
    assert (await asgi.delete("/api/datasets/small-csv")).status_code == 204
    assert (await asgi.get("/api/datasets/small-csv")).status_code == 404
    assert sorted(d["name"] for d in (await asgi.get("/api/datasets")).json()["data"]) == ["tiny"]


async def test_a_dataset_in_use_cannot_be_deleted_or_replaced(asgi: httpx.AsyncClient) -> None:
    await upload_digits(asgi)
    job = (await asgi.post("/api/jobs", json=ENDLESS)).json()
    r = await asgi.delete("/api/datasets/digits")
    assert r.status_code == 409 and job["id"] in r.json()["detail"]
    X, y = tiny_xy(seed=5)
    replacement: dict[str, Any] = {
        "data": {"name": "digits", "overwrite": "true"},
        "files": {"file": ("t.npz", npz_bytes(X, y))},
    }
    r = await asgi.post("/api/datasets", **replacement)
    assert r.status_code == 409 and "cancel" in r.json()["detail"]
    assert (await asgi.get("/api/datasets/digits")).json()["n_rows"] == 1797
    await asgi.post(f"/api/jobs/{job['id']}/cancel")
    await wait_final(asgi, job["id"])
    r = await asgi.post("/api/datasets", **replacement)
    assert r.status_code == 201 and r.json()["n_rows"] == 240


async def test_downpour_adagrad_job_runs_through_the_api(asgi: httpx.AsyncClient) -> None:
    X, y = tiny_xy()
    # 40 epochs: with 20, the objective ended between 0.29 and 0.47 in 12 runs and once at 0.53 in CI (how
    # far stale pushes set Adagrad back varies with timing); with 40, between 0.26 and 0.33 in 12 runs.
    options = {"rule": "adagrad", "lr": 0.5, "replicas": 2, "epochs": 40, "l2": 1e-2}
    job = {
        "algorithm": "downpour-sgd",
        "dataset": "tiny",
        "eval_dataset": "tiny",
        "model": LOGISTIC,
        "options": options,
    }
    r = await asgi.post("/api/jobs", json=job)
    assert r.status_code == 201, r.text
    record = await wait_final(asgi, r.json()["id"], timeout=120)
    assert record["status"] == "succeeded", record["message"]
    w = np.load(io.BytesIO((await asgi.get(f"/api/jobs/{record['id']}/params")).content))
    ref = scipy_logistic(X, y, 1e-2)
    f, _ = models.objective(models.Logistic(4), w, X, y, l2=1e-2)
    # Asynchronous SGD is noisy: it must have learned (F(0) = log 2 = 0.69, the optimum 0.25), no more.
    assert ref.fun <= f < 0.5
    model = models.Logistic(4)
    assert record["result"]["eval_accuracy"] == pytest.approx(
        float(np.mean(model.predict(w, X) == y)), abs=1e-12
    )
    metrics = (await asgi.get(f"/api/jobs/{record['id']}/metrics")).json()
    assert metrics["dim"] == "step"
    steps = metrics["columns"]["step"]
    assert len(steps) >= 2 and steps == sorted(steps) and record["iterations"] == steps[-1]
    assert {"train_loss", "test_loss", "test_accuracy"} <= set(metrics["columns"])


async def test_token_guards_every_route_but_health(
    tmp_path: Path, client: DaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[bytes, bytes]] = []
    real = secrets.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(secrets, "compare_digest", spy)  # the module api.settings calls it from
    async with running_app(settings_for(tmp_path), client) as (_, http):
        anonymous = httpx.AsyncClient(transport=http._transport, base_url="http://testserver")
        async with anonymous:
            assert (await anonymous.get("/api/health")).json()["status"] == "ok"
            assert (await anonymous.get("/")).status_code == 200  # the page itself; its data needs the token
            for method, path in [
                ("GET", "/api/jobs"),
                ("POST", "/api/jobs"),
                ("GET", "/api/jobs/0123456789abcdef"),
                ("GET", "/api/jobs/0123456789abcdef/events"),
                ("GET", "/api/datasets"),
                ("POST", "/api/datasets"),
                ("GET", "/api/models"),
                ("GET", "/api/cluster"),
            ]:
                r = await anonymous.request(method, path)
                assert r.status_code == 401 and "Bearer" in r.json()["detail"], (method, path)
            wrong = await anonymous.get("/api/jobs", headers={"Authorization": "Bearer " + "x" * len(TOKEN)})
            assert wrong.status_code == 401 and "wrong" in wrong.json()["detail"]
            assert seen[-1] == (b"x" * len(TOKEN), TOKEN.encode())
        assert (await http.get("/api/jobs")).status_code == 200
        assert seen[-1] == (TOKEN.encode(), TOKEN.encode())
