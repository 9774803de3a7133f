"""Downpour's ``fuse``, ``compression`` and ``max_coalesce`` through the service: the JSON options map to
``downpour.train``'s (``{"tau": t}`` to ``downpour.Compression(tau=t)``), the Python client sends the Python
API's objects as that JSON, and a real job runs with each. Their bad forms are in test_bad_input.py (and,
with ``partitions``, in test_partitions.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from distbelief import downpour, models
from distbelief.api import Client
from distbelief.api.runner import RunContext, downpour_kwargs, run_downpour
from distbelief.errors import InvalidOptionError
from tests.api.conftest import LOGISTIC, wait_final


class _Called(Exception):
    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("called")
        self.kwargs = kwargs


def test_the_runner_hands_downpour_train_the_python_options(monkeypatch: pytest.MonkeyPatch) -> None:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise _Called(kwargs)

    monkeypatch.setattr(downpour, "train", stand_in)
    options = {"epochs": 1, "fuse": False, "max_coalesce": 3, "compression": {"tau": 0.25}}
    ctx = RunContext(
        job_id="0" * 16, algorithm="downpour-sgd", model=models.Logistic(4), data=None,  # type: ignore[arg-type]
        eval_data=None, options=options, client=None, store="/nowhere",  # type: ignore[arg-type]
        callback=lambda record: None, resume=False,
    )  # fmt: skip
    with pytest.raises(_Called) as called:
        run_downpour(ctx)
    got = called.value.kwargs
    assert got["fuse"] is False and got["max_coalesce"] == 3
    assert got["compression"] == downpour.Compression(tau=0.25)
    assert options["compression"] == {"tau": 0.25}  # the stored options stay JSON
    assert downpour_kwargs({"compression": None}) == {"compression": None}
    for bad in (0.25, {"tau": 0.25, "x": 1}, {}):
        with pytest.raises(InvalidOptionError, match=r'expected null .* or \{"tau": \.\.\.\}'):
            downpour_kwargs({"compression": bad})


def test_the_client_sends_a_compression_object_as_its_json() -> None:
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(201, json={"id": "x", "status": "queued"})

    spec: dict[str, Any] = {
        "algorithm": "downpour-sgd",
        "dataset": "tiny",
        "model": LOGISTIC,
        "options": {"epochs": 1, "compression": downpour.Compression(tau=0.5), "fuse": False},
    }
    with Client("http://testserver", transport=httpx.MockTransport(handler)) as api:
        assert api.submit(spec)["status"] == "queued"
    assert sent[0]["options"] == {"epochs": 1, "compression": {"tau": 0.5}, "fuse": False}
    assert isinstance(spec["options"]["compression"], downpour.Compression)  # the caller's dict untouched


@pytest.mark.anyio
async def test_a_downpour_job_runs_with_fuse_compression_and_max_coalesce(asgi: httpx.AsyncClient) -> None:
    # One replica on the tiny problem (5 parameters, one shard), the three options at once (a job each
    # would triple the time): unfused (the default fuses every push with the next fetch), compressed with
    # a large threshold (few entries a push, 4 bytes each), at most 2 steps summed a push.
    options = {"epochs": 2, "replicas": 1, "rule": "sgd", "lr": 0.2, "fuse": False,
               "compression": {"tau": 0.5}, "max_coalesce": 2}  # fmt: skip
    body = {"algorithm": "downpour-sgd", "dataset": "tiny", "model": LOGISTIC, "options": options}
    r = await asgi.post("/api/jobs", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["options"] == options  # stored as given: a restart runs it with the same options
    record = await wait_final(asgi, r.json()["id"])
    assert record["status"] == "succeeded", record["message"]
    result = record["result"]
    assert result["stop_reason"] == "epochs"
    assert result["objective"] < 0.69  # below log 2: it learned (F at w = 0)
    stats = result["stats"]
    assert stats["fused_pushes"] == 0
    # 5 float64 a dense push; at most 5 entries of 4 bytes and one 8-byte tau a compressed one.
    assert stats["bytes_pushed"] <= 28 * stats["pushes"]
    # SGD sums every step while its pushes are outstanding; max_coalesce=2 sends one every 2 steps at least.
    assert stats["pushes"] >= result["steps"] // 2


@pytest.mark.anyio
async def test_deterministic_jobs_give_the_same_parameters_and_bad_combinations_are_refused(
    asgi: httpx.AsyncClient,
) -> None:
    import io

    import numpy as np

    options = {"epochs": 3, "replicas": 2, "rule": "adagrad", "lr": 0.2, "n_fetch": 2, "n_push": 2,
               "deterministic": True}  # fmt: skip
    body = {"algorithm": "downpour-sgd", "dataset": "tiny", "model": LOGISTIC, "options": options}
    params = []
    for _ in range(2):
        r = await asgi.post("/api/jobs", json=body)
        assert r.status_code == 201, r.text
        record = await wait_final(asgi, r.json()["id"])
        assert record["status"] == "succeeded", record["message"]
        got = await asgi.get(f"/api/jobs/{record['id']}/params")
        params.append(np.load(io.BytesIO(got.content)))
    np.testing.assert_array_equal(params[0], params[1])
    for bad, what in [({"n_fetch": 1, "n_push": 2}, "n_fetch"), ({"warmstart_steps": 3}, "warmstart_steps")]:
        r = await asgi.post("/api/jobs", json={**body, "options": {**options, **bad}})
        assert r.status_code == 422 and what in r.text and "deterministic" in r.text, r.text
