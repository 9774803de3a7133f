"""Model parallelism through the service: locally connected model kinds, the ``partitions`` option (checked
against the model, the algorithm and the workers' memory), and a job's replicas as groups of partitions."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
from distributed import Client as DaskClient

from distbelief import models
from distbelief.api._admission import WorkerMemory, admit, estimate_cost
from distbelief.api.schemas import JobPublic, ReplicaPlacementPublic
from tests.api.conftest import LOGISTIC, running_app, settings_for, upload_digits, wait_final

LC2D: dict[str, Any] = {
    "kind": "locally_connected_2d",
    "image_shape": [8, 8],
    "n_classes": 10,
    "patches": [3, 3],
    "filters": [4, 2],
}
LC1D: dict[str, Any] = {"kind": "locally_connected", "n_features": 64, "n_classes": 10, "fields": [8, 4]}


def _downpour(model: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {
        "algorithm": "downpour-sgd",
        "dataset": "digits",
        "model": model,
        "options": {"max_steps": 4, "batch_size": 16, **options},
    }


@pytest.mark.parametrize("spec", [LC1D, LC2D])
def test_the_estimate_counts_locally_connected_models_and_a_partitions_share(spec: dict[str, Any]) -> None:
    model = models.from_spec(spec)
    whole = estimate_cost(spec, "downpour-sgd", {}, n_rows=1797, portion_rows=100, n_workers=2)
    assert whole.n_params == model.n_params and whole.bytes_per_partition is None
    split = estimate_cost(spec, "downpour-sgd", {"partitions": 2}, n_rows=1797, portion_rows=100, n_workers=2)
    plan = models.partition_plan(model, 2)
    widest = max(b - a for a, b in zip(plan.bounds[:-1], plan.bounds[1:], strict=True))
    assert split.shards == 2 and split.bytes_per_shard == widest * 5 * 8  # Downpour keeps 5 vectors a shard
    assert split.bytes_per_partition is not None
    # A partition's worker holds its shard too (5 vectors) and the partition's copy and gradient of the slice.
    assert 7 * widest * 8 < split.bytes_per_partition < whole.bytes_per_replica + whole.bytes_per_shard


@pytest.mark.anyio
async def test_bad_specs_and_partitions_get_422_and_nothing_is_stored(
    tmp_path: Path, client: DaskClient
) -> None:
    async with running_app(settings_for(tmp_path), client) as (_, http):
        await upload_digits(http)
        jobs_before = sorted(os.listdir(tmp_path / "jobs"))
        bad: list[tuple[dict[str, Any], str]] = [
            (_downpour({**LC2D, "patches": [9, 3]}), "cannot feed a 9 x 9 patch"),
            (_downpour({**LC2D, "image_shape": [8]}), "image_shape"),
            (_downpour({**LC2D, "filters": [4]}), "same length"),
            (_downpour({**LC1D, "fields": [65]}), "receptive field of 65"),
            (_downpour({**LC1D, "field": [3]}), "did you mean 'fields'"),
            (_downpour({**LC2D, "image_shape": [9, 9]}), "81"),  # the digits have 64 features
            (_downpour(LC2D, partitions=0), "partitions"),
            (_downpour(LC2D, partitions=1.5), "partitions"),
            (_downpour(LC2D, partitions=65), "partitions"),
            (_downpour(LC2D, partitions=5), "at most 4 partitions"),  # the second map has 4 rows
            (
                _downpour({"kind": "softmax", "n_features": 64, "n_classes": 10}, partitions=2),
                "cannot be partitioned",
            ),
            (_downpour(LC2D, partitions=2, warmstart_steps=3), "warmstart_steps=3 is not supported with"),
            (
                _downpour(LC2D, partitions=2, compression={"tau": 0.1}),
                "compression={'tau': 0.1} is not supported with partitions=2",
            ),
            (
                _downpour(LC2D, partitions=2, max_coalesce=4),
                "max_coalesce=4 is not supported with partitions=2",
            ),
            (
                _downpour(LC2D, partitions=2, max_steps=None, time_limit=5.0),
                "time_limit=5.0 is not supported",
            ),
        ]
        for body, match in bad:
            body["options"] = {k: v for k, v in body["options"].items() if v is not None}
            r = await http.post("/api/jobs", json=body)
            assert r.status_code == 422, (body, r.text)
            assert match in r.text, (match, r.text)
        assert sorted(os.listdir(tmp_path / "jobs")) == jobs_before
        sandblaster = {
            "algorithm": "sandblaster-lbfgs",
            "dataset": "digits",
            "model": LC2D,
            "options": {"maxiter": 1, "partitions": 2},
        }
        r = await http.post("/api/jobs", json=sandblaster)
        assert r.status_code == 201, r.text  # sandblaster.minimize(partitions=K): passed through
        assert r.json()["options"]["partitions"] == 2
        record = await wait_final(http, r.json()["id"])
        assert record["status"] == "succeeded", record["message"]
        assert record["result"]["nit"] == 1


@pytest.mark.anyio
async def test_admission_weighs_a_partition_and_a_job_shows_its_replicas_as_groups_of_partitions(
    tmp_path: Path, client: DaskClient
) -> None:
    limit, n_workers = WorkerMemory(client, ttl=0).get()
    assert limit is not None
    spec = {**LC2D, "filters": [16, 8]}
    costs = {
        k: estimate_cost(
            spec, "downpour-sgd", {"partitions": k}, n_rows=1797, portion_rows=1, n_workers=n_workers
        )
        for k in (1, 2, 4)
    }
    whole = max(costs[1].bytes_per_replica, costs[1].bytes_per_shard)
    half, quarter = costs[2].bytes_per_partition, costs[4].bytes_per_partition
    assert half is not None and quarter is not None and quarter < min(whole, half)
    # A worker budget between what one partition of four needs and what half (or all) of the model needs.
    fraction = (quarter + min(whole, half)) / 2 / limit
    async with running_app(settings_for(tmp_path, job_memory_fraction=fraction), client) as (_, http):
        await upload_digits(http)
        r = await http.post("/api/jobs", json=_downpour(spec))
        assert r.status_code == 422 and "would need" in r.text, r.text
        r = await http.post("/api/jobs", json=_downpour(spec, partitions=2))
        assert r.status_code == 422 and "a partition would need" in r.text, r.text
        assert "more partitions (option 'partitions') spread it" in r.text

        # Four partitions of that model fit (checked here without running it: the job below runs a smaller
        # model), and so does the small model in two partitions.
        settings = settings_for(tmp_path, job_memory_fraction=fraction)
        memory = WorkerMemory(client, ttl=0)
        for model, k in ((spec, 4), (LC2D, 2)):
            cost = admit(model, "downpour-sgd", {"partitions": k}, n_rows=1797, portion_rows=1,
                         settings=settings, memory=memory)  # fmt: skip
            assert cost.bytes_per_partition is not None and cost.bytes_per_partition <= fraction * limit

        r = await http.post("/api/jobs", json=_downpour(LC2D, partitions=2, replicas=2, max_steps=4))
        assert r.status_code == 201, r.text
        assert r.json()["options"]["partitions"] == 2
        record = await wait_final(http, r.json()["id"])
        assert record["status"] == "succeeded", record["message"]
        workers = {w["address"] for w in (await http.get("/api/cluster")).json()["workers"]}
        groups = record["placement"]
        assert [g["replica"] for g in groups] == [0, 1]
        for group in groups:
            assert [p["partition"] for p in group["partitions"]] == [0, 1]
            assert {p["worker"] for p in group["partitions"]} <= workers
            assert all(p["steps"] == 2 for p in group["partitions"])
            assert all(p["messages"] > 0 and p["bytes"] > 0 for p in group["partitions"])
        result = record["result"]
        assert result["stats"]["partitions"] == 2 and result["steps"] == 4
        # No l2: the objective is the training loss, evaluated at the end like every job's.
        assert math.isfinite(result["train_loss"]) and result["objective"] == result["train_loss"]


def test_a_running_jobs_placement_follows_its_partition_actors() -> None:
    # The watcher of a running partitioned job, on a stand-in for the runner's scheduler query: the record
    # gets the groups as soon as the actors are placed, and is left alone once the run has ended.
    import threading
    import time
    from types import SimpleNamespace

    from distbelief.api.runner import JobRunner, _Job

    table: list[dict[str, Any]] = [{"key": "shard-0-x", "kind": "shard", "job_id": "j", "worker": "tcp://a"}]
    notified: list[str] = []
    fake = SimpleNamespace(actors=lambda: list(table), _stopping=threading.Event(), _notify=notified.append)
    record = JobPublic(
        id="j", algorithm="downpour-sgd", model=LOGISTIC, dataset="d", options={}, status="running",
        created_at="2026-01-01T00:00:00+00:00",
    )  # fmt: skip
    job = _Job.of(record)
    done = JobRunner._watch_placement(fake, job, every=0.01)  # type: ignore[arg-type]
    time.sleep(0.05)
    assert record.placement is None  # no partition yet
    table += [
        {"key": "partition-0-1-r", "kind": "partition", "job_id": "j", "worker": "tcp://b", "replica": 0,
         "partition": 1},
        {"key": "partition-0-0-r", "kind": "partition", "job_id": "j", "worker": "tcp://a", "replica": 0,
         "partition": 0},
        {"key": "partition-0-0-q", "kind": "partition", "job_id": "other", "worker": "tcp://c", "replica": 0,
         "partition": 0},
    ]  # fmt: skip
    deadline = time.monotonic() + 10
    while record.placement is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert record.placement is not None
    assert [g.model_dump(exclude_none=True) for g in record.placement] == [
        {
            "replica": 0,
            "partitions": [{"partition": 0, "worker": "tcp://a"}, {"partition": 1, "worker": "tcp://b"}],
        }
    ]
    assert notified and set(notified) == {"j"}
    done.set()
    final = [ReplicaPlacementPublic(replica=0, partitions=[])]
    record.placement = final
    table[1]["worker"] = "tcp://moved"
    time.sleep(0.05)
    assert record.placement is final


def test_a_partitioned_downpour_job_reports_progress_and_stops_when_its_callback_says(
    tmp_path: Path, client: DaskClient
) -> None:
    # The runner hands a partitioned run the job's callback: rows reach the metrics, a cancel stops it.
    from distbelief.api.runner import RunContext, run_downpour
    from distbelief.storage import Dataset, train_test_split_digits

    X, y, _, _ = train_test_split_digits(seed=0)
    data = Dataset.from_arrays(
        X, y, path=tmp_path / "d", portion_rows=512, label_kind="classes", n_classes=10
    )
    rows: list[Any] = []

    def cancel_after_two(record: Any) -> None:
        rows.append(record)
        if len(rows) >= 2:
            raise StopIteration

    ctx = RunContext(
        job_id="j", algorithm="downpour-sgd", model=models.LocallyConnected(64, 10, fields=[6], strides=[2]),
        data=data, eval_data=None, options={"partitions": 2, "max_steps": 100_000, "rule": "sgd"},
        client=client, store=str(tmp_path / "run"), callback=cancel_after_two, resume=False,
    )  # fmt: skip
    outcome = run_downpour(ctx)
    assert len(rows) == 2 and rows[-1].step > 0
    assert outcome.summary["stop_reason"] == "callback" and outcome.summary["steps"] < 100_000
