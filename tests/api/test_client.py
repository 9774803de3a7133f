"""``api.client.Client`` and the ``distbelief`` CLI against a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from distbelief import models
from distbelief.api import ApiError, Client
from distbelief.api.cli import main
from distbelief.storage import load_digits
from tests.api.conftest import LOGISTIC, TOKEN, scipy_logistic, tiny_xy


@pytest.fixture
def api(server: str) -> Iterator[Client]:
    with Client(server, TOKEN) as c:
        yield c


def test_submit_wait_metrics_params_match_the_oracle(api: Client, capsys: pytest.CaptureFixture[str]) -> None:
    job = api.submit(
        {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC, "options": {"l2": 0.1}}
    )
    record = api.wait(job["id"], timeout=120)
    assert record["status"] == "succeeded"
    assert f"sandblaster-lbfgs {job['id'][:8]}" in capsys.readouterr().err  # the progress bar

    ref = scipy_logistic(*tiny_xy(), 0.1)
    w = api.params(job["id"])
    assert isinstance(w, np.ndarray) and w.dtype == np.float64
    np.testing.assert_allclose(w, ref.x, rtol=1e-4, atol=1e-6)

    metrics = api.metrics(job["id"])
    assert isinstance(metrics, xr.Dataset)
    assert list(metrics.iteration.values) == list(range(record["result"]["nit"] + 1))
    assert float(metrics.objective[-1]) == pytest.approx(ref.fun, rel=1e-8)
    assert {"grad_norm", "step", "nfev", "round_trips"} <= set(metrics.data_vars)

    assert job["id"] in [j["id"] for j in api.jobs()]
    assert api.job(job["id"])["result"]["fun"] == pytest.approx(ref.fun, rel=1e-8)
    assert [j["id"] for j in api.jobs(status="succeeded")].count(job["id"]) == 1


def test_http_errors_carry_the_servers_message(api: Client, server: str) -> None:
    with pytest.raises(ApiError) as err:
        api.submit(
            {
                "algorithm": "sandblaster-lbfgs",
                "dataset": "tiny",
                "model": {"kind": "logistic", "n_features": 9},
            }
        )
    assert err.value.status_code == 422
    assert "n_features=4" in err.value.detail and "n_features=4" in str(err.value)
    with pytest.raises(ApiError, match="no job with id") as missing:
        api.job("0" * 16)
    assert missing.value.status_code == 404
    with Client(server, "wrong-token-xxxxxxxxxx") as bad, pytest.raises(ApiError) as denied:
        bad.jobs()
    assert denied.value.status_code == 401 and "wrong" in denied.value.detail


def test_upload_events_cancel_and_delete(api: Client) -> None:
    X, y = load_digits()
    info = api.upload_dataset("digits", X, y)
    assert (info["n_rows"], info["n_features"], info["n_classes"]) == (1797, 64, 10)
    assert "digits" in [d["name"] for d in api.datasets()]
    spec = {"kind": "softmax", "n_features": 64, "n_classes": 10}
    job = api.submit(
        {
            "algorithm": "sandblaster-cg",
            "dataset": "digits",
            "model": spec,
            "options": {"maxiter": 8, "gtol": 0.0},
        }
    )
    kinds, rows = [], 0
    for event, data in api.events(job["id"]):
        kinds.append(event)
        if event == "metrics":
            rows = len(data["rows"]) if data["reset"] else rows + len(data["rows"])
    assert kinds[-1] == "end" and "status" in kinds
    assert rows == 9 == api.metrics(job["id"]).sizes["iteration"]
    w = api.params(job["id"])
    f, _ = models.objective(models.Softmax(64, 10), w, X, y)
    assert f == pytest.approx(api.job(job["id"])["result"]["fun"], rel=1e-12)

    endless_spec = {
        "algorithm": "sandblaster-gd",
        "dataset": "digits",
        "options": {"gtol": 0.0, "ftol": 0.0, "maxiter": 10**5},
    }
    endless = api.submit({**endless_spec, "model": spec})
    assert api.cancel(endless["id"])["cancel_requested"]
    assert api.wait(endless["id"], timeout=120, progress=False)["status"] == "cancelled"
    api.delete(endless["id"])
    with pytest.raises(ApiError, match="no job"):
        api.job(endless["id"])
    slow = api.submit({**endless_spec, "model": spec})
    with pytest.raises(TimeoutError, match="still"):
        api.wait(slow["id"], timeout=0.2, progress=False)
    api.cancel(slow["id"])
    api.wait(slow["id"], timeout=120, progress=False)


def test_cli_submit_and_status(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", TOKEN)
    path = tmp_path / "job.json"
    path.write_text(
        json.dumps(
            {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC, "name": "from the cli"}
        )
    )
    assert main(["submit", str(path), "--wait", "--url", server]) == 0
    out = capsys.readouterr().out
    job = json.loads(out[out.index("{") :])
    assert job["status"] == "succeeded" and job["name"] == "from the cli"
    assert main(["status", "--url", server]) == 0
    assert job["id"] in capsys.readouterr().out
    assert main(["status", job["id"], "--url", server]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == job["id"]
    path.write_text(json.dumps({"algorithm": "sandblaster-lbfgs", "dataset": "nope", "model": LOGISTIC}))
    assert main(["submit", str(path), "--url", server]) == 1
    assert "no dataset named 'nope'" in capsys.readouterr().err
    path.write_text("{not json")
    assert main(["submit", str(path), "--url", server]) == 2
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", "")
    assert main(["status", "--url", server]) == 1
    assert "HTTP 401" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["../datasets/digits", "..", ".", "", "a?b=1", "a/cancel", "a#b", "x y"])
def test_an_id_or_name_is_one_path_segment_never_another_route(bad: str) -> None:
    # "../datasets/digits" as a job id made DELETE /api/jobs/{id} delete the dataset "digits".
    from urllib.parse import quote

    import httpx

    from distbelief.errors import InvalidOptionError

    sent: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.raw_path.decode())
        return httpx.Response(404, json={"detail": "no such thing"})

    calls = {
        "/api/jobs/{}": ("delete", "job"),
        "/api/jobs/{}/cancel": ("cancel",),
        "/api/jobs/{}/params": ("params",),
        "/api/jobs/{}/metrics": ("metrics",),
        "/api/datasets/{}": ("dataset", "delete_dataset"),
    }
    with Client("http://127.0.0.1:1", transport=httpx.MockTransport(record)) as c:
        for route, methods in calls.items():
            for method in methods:
                sent.clear()
                with pytest.raises((InvalidOptionError, ApiError)) as info:
                    getattr(c, method)(bad)
                if isinstance(info.value, InvalidOptionError):  # refused before anything was sent
                    assert not sent and bad in ("", ".", "..")
                else:  # sent, as one escaped path segment of the route it was meant for
                    assert sent == [route.format(quote(bad, safe=""))], method
