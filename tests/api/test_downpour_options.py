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

    spec = {
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
async def test_a_downpour_job_runs_with_each_of_fuse_compression_and_max_coalesce(
    asgi: httpx.AsyncClient,
) -> None:
    # One replica on the tiny problem (5 parameters, one shard): a fused run sends a push and the next
    # fetch as one message; compression with a large threshold sends few entries, 4 bytes each.
    base = {"epochs": 3, "replicas": 1, "rule": "sgd", "lr": 0.2}
    jobs = {
        "control": base,
        "unfused": {**base, "fuse": False},
        "compressed": {**base, "compression": {"tau": 0.5}},
        "coalesce": {**base, "max_coalesce": 2},
    }
    ids = {}
    for name, options in jobs.items():
        body = {"algorithm": "downpour-sgd", "dataset": "tiny", "model": LOGISTIC, "options": options}
        r = await asgi.post("/api/jobs", json=body)
        assert r.status_code == 201, r.text
        assert r.json()["options"] == options
        ids[name] = r.json()["id"]
    done = {name: await wait_final(asgi, job_id) for name, job_id in ids.items()}
    for name, record in done.items():
        assert record["status"] == "succeeded", (name, record["message"])
        assert record["result"]["stop_reason"] == "epochs", name
        assert record["result"]["objective"] < 0.69, name  # below log 2: it learned (F at w = 0)
    stats = {name: record["result"]["stats"] for name, record in done.items()}
    assert stats["control"]["fused_pushes"] > 0 and stats["unfused"]["fused_pushes"] == 0
    per_push = {name: s["bytes_pushed"] / s["pushes"] for name, s in stats.items()}
    # 5 float64 a dense push; at most 5 entries of 4 bytes and one 8-byte tau a compressed one.
    assert per_push["control"] == 40 and per_push["compressed"] <= 28
    # SGD sums every step while its pushes are outstanding; max_coalesce=2 sends one every 2 steps at least.
    steps = done["coalesce"]["result"]["steps"]
    assert stats["coalesce"]["pushes"] >= steps // 2
    # What the job stored is the JSON it was given (a restart runs it with the same options).
    stored = (await asgi.get(f"/api/jobs/{ids['compressed']}")).json()
    assert stored["options"]["compression"] == {"tau": 0.5}
