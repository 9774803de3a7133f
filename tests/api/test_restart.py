"""Stop the server mid-job and start it again on the same store: finished jobs are all there, a running job
(Sandblaster or Downpour) resumes from its last checkpoint, and one without a checkpoint starts over."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from distributed import Client as DaskClient

from distbelief import models, sandblaster
from distbelief.api.schemas import JobPublic
from distbelief.downpour._resume import checkpoint_vector, resume_point
from distbelief.storage import Dataset, load_digits
from tests.api.conftest import LOGISTIC, npz_bytes, running_app, settings_for, wait_final, wait_iterations

pytestmark = pytest.mark.anyio

SOFTMAX = {"kind": "softmax", "n_features": 64, "n_classes": 10}
# A fixed number of iterations: no convergence test may end the run early.
# 120 iterations (the run would converge at 162): the app stops at checkpoint 6, and over 100 iterations
# (~1 s) are left to keep the job running while it does, even on a loaded machine.
LONG: dict[str, Any] = {"gtol": 0.0, "ftol": 0.0, "maxiter": 120, "l2": 1e-3, "checkpoint_every": 3}


async def submit(http: httpx.AsyncClient, algorithm: str, options: dict[str, Any]) -> dict[str, Any]:
    """Submit a softmax job on the uploaded digits."""
    body = {"algorithm": algorithm, "dataset": "digits", "model": SOFTMAX, "options": options}
    job: dict[str, Any] = (await http.post("/api/jobs", json=body)).json()
    return job


async def test_a_running_job_resumes_from_its_checkpoint_after_a_restart(
    tmp_path: Path, client: DaskClient
) -> None:
    X, y = load_digits()
    settings = settings_for(tmp_path)
    async with running_app(settings, client) as (_, http):
        await http.post("/api/datasets", data={"name": "digits"}, files={"file": ("d.npz", npz_bytes(X, y))})
        short = await submit(http, "sandblaster-lbfgs", {"maxiter": 5})
        finished = await wait_final(http, short["id"])
        finished_metrics = (await http.get(f"/api/jobs/{short['id']}/metrics")).json()
        long = await submit(http, "sandblaster-lbfgs", LONG)
        for _ in range(600):
            record = (await http.get(f"/api/jobs/{long['id']}")).json()
            if (record["checkpoint_iteration"] or 0) >= 6:
                break
            await anyio.sleep(0.05)
        assert record["status"] == "running", record
    # The app has stopped: the job was interrupted, and the store says it was running.
    stored = json.loads((tmp_path / "jobs" / long["id"] / "job.json").read_text())
    assert stored["status"] == "running" and stored["iterations"] < LONG["maxiter"]
    checkpoint = stored["checkpoint_iteration"]
    assert checkpoint >= 6

    async with running_app(settings, client) as (_, http):
        again = (await http.get(f"/api/jobs/{short['id']}")).json()
        assert again == finished
        assert (await http.get(f"/api/jobs/{short['id']}/metrics")).json() == finished_metrics
        resumed = await wait_final(http, long["id"])
        assert resumed["status"] == "succeeded", resumed["message"]
        assert resumed["resumed_from"] == checkpoint and resumed["restarts"] == 1
        assert resumed["result"]["nit"] == LONG["maxiter"]
        iterations = (await http.get(f"/api/jobs/{long['id']}/metrics")).json()["columns"]["iteration"]
        assert iterations == list(range(LONG["maxiter"] + 1))
        w = np.load(__import__("io").BytesIO((await http.get(f"/api/jobs/{long['id']}/params")).content))

    # The oracle: the same run without an interruption.
    model = models.Softmax(64, 10)
    ds = Dataset.in_store(tmp_path / "datasets", "digits")
    opts = {k: v for k, v in LONG.items() if k != "checkpoint_every"}
    ref = sandblaster.minimize(model, ds, client=client, store=str(tmp_path / "oracle"), **opts)
    assert resumed["result"]["fun"] == pytest.approx(ref.fun, rel=1e-9)
    np.testing.assert_allclose(w, ref.x, rtol=1e-6, atol=1e-9)


async def test_jobs_that_cannot_resume_are_failed_or_started_over(tmp_path: Path, client: DaskClient) -> None:
    settings = settings_for(tmp_path)
    async with running_app(settings, client) as (_, http):
        X, y = load_digits()
        await http.post("/api/datasets", data={"name": "digits"}, files={"file": ("d.npz", npz_bytes(X, y))})
        base = (
            await http.post(
                "/api/jobs",
                json={
                    "algorithm": "sandblaster-lbfgs",
                    "dataset": "digits",
                    "model": SOFTMAX,
                    "options": {"maxiter": 3},
                },
            )
        ).json()
        await wait_final(http, base["id"])
    # What a server killed mid-run leaves: records that still say "running".
    template = json.loads((tmp_path / "jobs" / base["id"] / "job.json").read_text())
    for job_id, algorithm, options, status in [
        ("aaaaaaaaaaaaaaaa", "downpour-sgd", {"epochs": 2}, "running"),
        ("bbbbbbbbbbbbbbbb", "sandblaster-lbfgs", {"maxiter": 4}, "running"),
        ("dddddddddddddddd", "sandblaster-gd", {"maxiter": 2}, "queued"),
    ]:
        record: dict[str, Any] = {
            **template,
            "id": job_id,
            "algorithm": algorithm,
            "options": options,
            "status": status,
            "result": None,
            "finished_at": None,
            "iterations": 2,
            "checkpoint_iteration": None,
        }
        (tmp_path / "jobs" / job_id).mkdir()
        (tmp_path / "jobs" / job_id / "job.json").write_text(json.dumps(record))
    (tmp_path / "jobs" / "cccccccccccccccc").mkdir()
    (tmp_path / "jobs" / "cccccccccccccccc" / "job.json").write_text("{torn")

    async with running_app(settings, client) as (_, http):
        # A Downpour job without a checkpoint (it never got to set its shards up) starts over.
        downpour_rerun = await wait_final(http, "aaaaaaaaaaaaaaaa")
        assert downpour_rerun["status"] == "succeeded", downpour_rerun["message"]
        assert downpour_rerun["restarts"] == 1 and downpour_rerun["resumed_from"] is None
        assert downpour_rerun["result"]["stop_reason"] == "epochs"
        rerun = await wait_final(http, "bbbbbbbbbbbbbbbb")
        assert rerun["status"] == "succeeded" and rerun["restarts"] == 1 and rerun["resumed_from"] is None
        assert (await http.get("/api/jobs/bbbbbbbbbbbbbbbb/metrics")).json()["columns"]["iteration"] == [
            0,
            1,
            2,
            3,
            4,
        ]
        queued = await wait_final(http, "dddddddddddddddd")
        assert queued["status"] == "succeeded" and queued["restarts"] == 0 and queued["result"]["nit"] == 2
        listed = sorted(j["id"] for j in (await http.get("/api/jobs")).json()["data"])
        assert listed == sorted([base["id"], "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "dddddddddddddddd"])


# Downpour on digits: ~56 steps an epoch with 2 replicas; 400 epochs (~22,000 steps) leave the job running
# well past the checkpoint the test waits for, even on a fast machine.
DOWNPOUR = {"epochs": 400, "lr": 0.3, "checkpoint_every_s": 0.2, "replicas": 2}


async def test_a_running_downpour_job_resumes_from_its_shard_checkpoint(
    tmp_path: Path, client: DaskClient
) -> None:
    X, y = load_digits()
    model = models.Softmax(64, 10)
    f0 = models.objective(model, model.init_params(0), X, y)[0]
    settings = settings_for(tmp_path)
    async with running_app(settings, client) as (_, http):
        await http.post("/api/datasets", data={"name": "digits"}, files={"file": ("d.npz", npz_bytes(X, y))})
        job = await submit(http, "downpour-sgd", DOWNPOUR)
        run_dir = tmp_path / "jobs" / job["id"] / "run"
        for _ in range(1200):
            point = resume_point(run_dir)
            if point is not None and point.step >= 3000:
                break
            await anyio.sleep(0.05)
        record = (await http.get(f"/api/jobs/{job['id']}")).json()
        assert record["status"] == "running", record
    # The app has stopped the job (its last checkpoint is taken as it stops) and left it "running".
    stored = json.loads((tmp_path / "jobs" / job["id"] / "job.json").read_text())
    assert stored["status"] == "running"
    point = resume_point(run_dir)
    assert point is not None and 3000 <= point.step < 400 * 56
    x_ckpt = checkpoint_vector(run_dir)
    f_ckpt = models.objective(model, x_ckpt, X, y)[0]
    assert f_ckpt < 0.5 * f0  # the checkpoint is far from the start

    async with running_app(settings, client) as (_, http):
        resumed = await wait_final(http, job["id"])
        assert resumed["status"] == "succeeded", resumed["message"]
        assert resumed["resumed_from"] == point.step and resumed["restarts"] == 1
        assert resumed["result"]["stop_reason"] == "epochs" and resumed["result"]["steps"] > point.step
        metrics = (await http.get(f"/api/jobs/{job['id']}/metrics")).json()["columns"]
        w = np.load(__import__("io").BytesIO((await http.get(f"/api/jobs/{job['id']}/params")).content))
    times = np.array(metrics["time"])
    objective = np.array(metrics["objective"], dtype=float)
    steps = np.array(metrics["step"])
    # The resumed run's first entry is the checkpoint itself: its time, its steps, its objective (not F(x0)).
    first = int(np.searchsorted(times, point.time))
    assert times[first] == pytest.approx(point.time) and steps[first] == point.step
    assert objective[first] == pytest.approx(f_ckpt, rel=1e-12)
    assert np.all(np.diff(times) > 0)  # the rows after the checkpoint were replaced, not appended
    # It went on from there (SGD noise: not always below the checkpoint's) and reached its target.
    assert models.objective(model, w, X, y)[0] < 0.1 * f0
    assert np.all(objective[first:] < 0.5 * f0)


def test_a_downpour_job_taken_up_again_keeps_its_metrics_rows_up_to_the_checkpoint_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Downpour's metrics rows are indexed by step: the rows kept on a restart are those up to the
    # checkpoint's step (they were compared with its time in seconds, which kept almost none).
    from distbelief.api._jobstore import JobStore
    from distbelief.api.runner import JobRunner
    from distbelief.downpour import _resume, internal

    point = _resume.ResumePoint(step=100, time=2.5, replicas=[], checkpoint_id=3, final=False)
    monkeypatch.setattr(internal, "resume_point", lambda store: point)  # where the runner looks it up
    store = JobStore(str(tmp_path))
    # What a record needs to be served (one without is set aside at start).
    record = JobPublic(
        id="bbbbbbbbbbbbbbbb", algorithm="downpour-sgd", status="running", options={},
        created_at="2026-01-01T00:00:00+00:00", model=LOGISTIC, dataset="tiny",
    )  # fmt: skip
    store.save_record(record)
    rows = [[float(step), step / 40.0, 1.0 / (1 + step)] for step in (0, 50, 100, 150, 200)]
    store.save_metrics(record.id, "step", ["step", "time", "objective"], rows)
    runner = JobRunner(settings_for(tmp_path), store, client=None)  # type: ignore[arg-type]
    runner._stopping.set()  # the job is taken up but must not run: there is no cluster
    try:
        runner.start()
        job = runner._jobs[record.id]
        assert job.record.status == "queued" and job.record.resumed_from == 100
        assert job.rows is not None and [r[0] for r in job.rows] == [0.0, 50.0, 100.0]
    finally:
        runner.stop(timeout=0.1)


def test_a_resumed_downpour_job_ends_with_its_rows_from_before_the_checkpoint(tmp_path: Path) -> None:
    # The resumed run's history starts at its checkpoint: the job's metrics keep the rows before it.
    import xarray as xr

    from distbelief.api._jobstore import JobStore
    from distbelief.api.runner import JobRunner, RunOutcome, _Job

    store = JobStore(str(tmp_path))
    runner = JobRunner(settings_for(tmp_path), store, client=None)  # type: ignore[arg-type]
    runner._evaluate = lambda *args: {}  # type: ignore[method-assign]
    record = JobPublic(
        id="cccccccccccccccc", algorithm="downpour-sgd", status="running", options={}, resumed_from=100,
        created_at="2026-01-01T00:00:00+00:00", model=LOGISTIC, dataset="tiny",
    )  # fmt: skip
    job = _Job.of(record, columns=["step", "objective"], rows=[[0.0, 2.0], [50.0, 1.5], [100.0, 1.2]])
    runner._jobs[record.id] = job
    history = xr.Dataset(
        {"objective": ("time", [1.2, 1.0, 0.9]), "step": ("time", [100, 150, 200])},
        coords={"time": [2.5, 3.0, 4.0]},
    )
    outcome = RunOutcome(x=np.zeros(2), history=history, summary={"stop_reason": "epochs", "message": "ok"})
    try:
        runner._finish(job, outcome, model=None, data=None, eval_data=None)  # type: ignore[arg-type]
        assert job.record.status == "succeeded" and job.columns[:2] == ["step", "objective"]
        assert job.rows is not None and [r[0] for r in job.rows] == [0.0, 50.0, 100.0, 150.0, 200.0]
        assert [r[1] for r in job.rows] == [2.0, 1.5, 1.2, 1.0, 0.9]
    finally:
        runner._stopping.set()
        runner.stop(timeout=0.1)


# Model parallelism: a locally connected network on the digits in 2 partitions. 600 steps leave the job
# running well past its first progress row (~30 steps) and the ~0.5 s its stop takes, and little to do after.
LC = {"kind": "locally_connected", "n_features": 64, "n_classes": 10, "fields": [6], "strides": [2]}
PARTITIONED = {"partitions": 2, "replicas": 1, "max_steps": 600, "lr": 0.1, "checkpoint_every_s": 0.2}


async def test_a_running_partitioned_job_resumes_from_its_shard_checkpoint(
    tmp_path: Path, client: DaskClient
) -> None:
    X, y = load_digits()
    model = models.from_spec(LC)
    perm = models.partition_plan(model, 2).perm
    f0 = models.objective(model, model.init_params(0), X, y)[0]
    settings = settings_for(tmp_path)
    body = {"algorithm": "downpour-sgd", "dataset": "digits", "model": LC, "options": PARTITIONED}
    async with running_app(settings, client) as (_, http):
        await http.post("/api/datasets", data={"name": "digits"}, files={"file": ("d.npz", npz_bytes(X, y))})
        job = (await http.post("/api/jobs", json=body)).json()
        run_dir = tmp_path / "jobs" / job["id"] / "run"
        # Stopped once it reports steps: the stop checkpoints it (a periodic checkpoint may not exist yet).
        record = await wait_iterations(http, job["id"], 1)
        assert record["status"] == "running", record
    # The app stopped the job after the step under way, checkpointed it with its exact step count, and
    # left it "running".
    stored = json.loads((tmp_path / "jobs" / job["id"] / "job.json").read_text())
    assert stored["status"] == "running"
    point = resume_point(run_dir)
    assert point is not None and point.final and record["iterations"] <= point.step < 600
    x_ckpt = np.empty(model.n_params)
    x_ckpt[perm] = checkpoint_vector(run_dir)
    f_ckpt = models.objective(model, x_ckpt, X, y)[0]
    assert f_ckpt < 0.9 * f0  # the checkpoint is well away from the start

    async with running_app(settings, client) as (_, http):
        resumed = await wait_final(http, job["id"])
        assert resumed["status"] == "succeeded", resumed["message"]
        assert resumed["resumed_from"] == point.step and resumed["restarts"] == 1
        result = resumed["result"]
        assert result["stop_reason"] == "max_steps" and result["steps"] == 600
        # Only the steps after the checkpoint ran again (a push per partition a step), on shards whose
        # clocks went on from the checkpoint's: every step of both runs applied once.
        assert result["stats"]["resumed_from"] == point.step
        assert result["stats"]["pushes"] == 2 * (600 - point.step)
        assert [c["applied"] for c in result["stats"]["shard_counters"]] == [600, 600]
        metrics = (await http.get(f"/api/jobs/{job['id']}/metrics")).json()["columns"]
    steps = np.array(metrics["step"])
    objective = np.array(metrics["objective"], dtype=float)
    assert np.all(np.diff(steps) >= 0) and steps[-1] == 600
    # The interrupted run's rows are kept up to the checkpoint; the resumed run's rows go on from there,
    # with the objective of the progress rows near the checkpoint's, not F(x0).
    assert steps[0] <= point.step and point.step in steps
    later = objective[(steps > point.step) & np.isfinite(objective)]
    assert later.size and np.all(later < 0.9 * f0)
    assert result["objective"] < f_ckpt


def test_a_job_whose_final_evaluation_fails_keeps_its_parameters_and_says_so(tmp_path: Path) -> None:
    # The run paid for its parameters: an evaluation that fails afterwards must not lose them.
    from distbelief.api._jobstore import JobStore
    from distbelief.api.runner import JobRunner, RunOutcome, _Job

    store = JobStore(str(tmp_path))
    runner = JobRunner(settings_for(tmp_path), store, client=None)  # type: ignore[arg-type]

    def lost(*args: object, **kwargs: object) -> dict[str, float]:
        raise TimeoutError("the evaluation of the final loss did not finish within 600 s")

    runner._evaluate = lost  # type: ignore[method-assign]
    record = JobPublic(
        id="dddddddddddddddd", algorithm="sandblaster-lbfgs", status="running", options={},
        created_at="2026-01-01T00:00:00+00:00", model=LOGISTIC, dataset="tiny",
    )  # fmt: skip
    job = _Job.of(record, columns=["iteration", "objective"], rows=[[0.0, 2.0]])
    runner._jobs[record.id] = job
    x = np.array([0.25, -1.5, 3.0])
    outcome = RunOutcome(x=x, history=None, summary={"message": "converged"})
    try:
        runner._finish(job, outcome, model=None, data=None, eval_data=None)  # type: ignore[arg-type]
        assert job.record.status == "failed" and job.record.message is not None
        assert "parameters are saved" in job.record.message and "TimeoutError" in job.record.message
        saved = store.load_params_bytes(record.id)
        assert saved is not None
        np.testing.assert_array_equal(np.load(io.BytesIO(saved)), x)
    finally:
        runner._stopping.set()
        runner.stop(timeout=0.1)


# job.json files as the service wrote them before the records were typed (captured from real jobs: an L-BFGS
# job with held-out rows, a partitioned Downpour job with its placement).
DATA = Path(__file__).parent / "data"
OLD_RECORDS = [DATA / "job_record_lbfgs.json", DATA / "job_record_partitioned.json"]


def test_a_record_is_written_byte_for_byte_as_before(tmp_path: Path) -> None:
    # Read both ways: a record read from a job.json of today's format is written back as the same bytes, so a
    # store moves between this service and the one before it and back.
    from distbelief.api._jobstore import JobStore

    store = JobStore(str(tmp_path))
    for path in OLD_RECORDS:
        record = JobPublic.model_validate_json(path.read_bytes())
        store.save_record(record)
        assert (tmp_path / "jobs" / record.id / "job.json").read_bytes() == path.read_bytes(), path.name


async def test_a_restarted_service_serves_the_records_an_earlier_one_wrote(
    tmp_path: Path, client: DaskClient
) -> None:
    old = [json.loads(path.read_text()) for path in OLD_RECORDS]
    # An older record still: before the fields of restarts, cancels and placement.
    older = {k: v for k, v in old[0].items() if k not in ("restarts", "cancel_requested", "placement")}
    older["id"] = "0123456789abcdef"
    for record in [*old, older]:
        (tmp_path / "jobs" / record["id"]).mkdir(parents=True)
        (tmp_path / "jobs" / record["id"] / "job.json").write_text(json.dumps(record))
    async with running_app(settings_for(tmp_path), client) as (_, http):
        for record in old:
            assert (await http.get(f"/api/jobs/{record['id']}")).json() == record
        served = (await http.get(f"/api/jobs/{older['id']}")).json()
        assert served == {**older, "restarts": 0, "cancel_requested": False, "placement": None}
        listed = (await http.get("/api/jobs")).json()
        assert listed["count"] == 3 and {j["id"] for j in listed["data"]} == {r["id"] for r in [*old, older]}
