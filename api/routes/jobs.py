"""``/api/jobs``: submit, list, inspect, follow (server-sent events), cancel and delete jobs."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import StreamingResponse

from distbelief.api.deps import RunnerDep, SettingsDep
from distbelief.api.schemas import FINAL_STATUSES, JobCreate, JobPublic, JobsPublic, JobStatus, MetricsPublic

from .._admission import WorkerMemory, admit
from .._fastpath import job_body
from .._http import error_responses
from .._jobstore import json_safe

__all__ = ["HEARTBEAT_SECONDS", "job_json", "router"]

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=error_responses(401, 422, 503))

# OpenAPI links from a created job to what can be done with it (tools such as schemathesis follow them).
_JOB_LINKS = {
    name: {"operationId": op, "parameters": {"job_id": "$response.body#/id"}}
    for name, op in {
        "GetJob": "get_job_api_jobs__job_id__get",
        "GetMetrics": "get_metrics_api_jobs__job_id__metrics_get",
        "CancelJob": "cancel_job_api_jobs__job_id__cancel_post",
        "GetParams": "get_params_api_jobs__job_id__params_get",
        "DeleteJob": "delete_job_api_jobs__job_id__delete",
    }.items()
}

#: An idle event stream sends a comment this often, so proxies and clients see it is alive.
HEARTBEAT_SECONDS = 15.0


@router.post(
    "",
    response_model=JobPublic,
    status_code=status.HTTP_201_CREATED,
    responses=error_responses(400, 413, 422),
    openapi_extra={"responses": {"201": {"links": _JOB_LINKS}}},
)
def create_job(body: JobCreate, runner: RunnerDep, settings: SettingsDep) -> JobPublic:
    """Queue a job: an algorithm, a built-in model by spec, a dataset (and a held-out one), options.

    Bad input (an unknown model kind, a model that does not fit the dataset, an option out of range, a job
    too big for the cluster or the limits of the settings) gets a 4xx whose ``detail`` says what to fix;
    nothing is stored then.
    """
    # Admitted under the datasets lock, shared (submissions do not wait for each other): a dataset cannot be
    # deleted or replaced between the check that it is there and the moment the queued job holds it
    # (DELETE /api/datasets/{name} then gets 409).
    with runner.store.datasets_lock.shared():
        data = runner.open_dataset(body.dataset)
        admit(
            body.model.model_dump(),
            body.algorithm,
            body.options,
            n_rows=data.n_rows,
            portion_rows=data.portion_rows,
            settings=settings,
            memory=WorkerMemory.of(runner.client),
        )
        return runner.submit(body)


@router.get("", response_model=JobsPublic, responses=error_responses(422))
async def list_jobs(
    runner: RunnerDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> JobsPublic:
    """Jobs, newest first, optionally only those with one status; ``limit`` / ``offset`` page them."""
    data, count = runner.list_jobs(status=status, limit=limit, offset=offset)
    return JobsPublic(data=data, count=count)


def job_json(record: JobPublic) -> Response:
    """A job record as the JSON response of a ``JobPublic`` (see :func:`api._fastpath.job_body`).

    Examples
    --------
    >>> job_json(record).media_type   # doctest: +SKIP
    'application/json'
    """
    return Response(job_body(record), media_type="application/json")


@router.get("/{job_id}", response_model=JobPublic, responses=error_responses(404))
async def get_job(job_id: str, runner: RunnerDep) -> Response:
    """One job: status, progress, latest metrics, and the result once it has finished."""
    # The plain case is answered before this route, by api._fastpath.StatusReadFastPath: keep the two alike.
    return job_json(runner.get(job_id))


@router.get(
    "/{job_id}/metrics",
    response_model=MetricsPublic,
    responses={200: {"content": {"text/csv": {}}}, **error_responses(404, 422)},
)
def get_metrics(job_id: str, runner: RunnerDep, format: Literal["json", "csv"] = "json") -> Any:
    """One row per iteration (Sandblaster) or step (Downpour); ``?format=csv`` for a CSV file."""
    dim, columns, rows = runner.metrics(job_id)
    if format == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(
            ["" if not math.isfinite(v) else (int(v) if j == 0 else repr(v)) for j, v in enumerate(row)]
            for row in rows
        )
        return Response(
            buf.getvalue(),
            media_type="text/csv",
            headers={"Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"'},
        )
    data = {c: [row[j] for row in rows] for j, c in enumerate(columns)}
    return {"job_id": job_id, "dim": dim, "columns": json_safe(data)}


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(json_safe(data), separators=(',', ':'))}\n\n"


@router.get(
    "/{job_id}/events",
    responses={200: {"content": {"text/event-stream": {}}}, **error_responses(404)},
)
async def job_events(job_id: str, request: Request, runner: RunnerDep) -> StreamingResponse:
    """Server-sent events: ``status`` (the job, on every change of status), ``metrics`` (new rows; ``reset``
    means they replace all earlier ones), and ``end`` once the job has finished."""
    sub = runner.subscribe(job_id)  # (a 404 now, not inside the stream)

    async def stream() -> AsyncIterator[str]:
        try:
            cursor, generation, last_status = 0, -1, None
            while True:
                sub.event.clear()
                snap = runner.snapshot(job_id, cursor, generation)
                record = snap.record
                if snap.generation != generation or snap.rows:
                    yield _event(
                        "metrics",
                        {
                            "dim": snap.dim,
                            "columns": snap.columns,
                            "rows": snap.rows,
                            "reset": snap.generation != generation,
                        },
                    )
                    cursor, generation = snap.total, snap.generation
                if record.status != last_status:
                    last_status = record.status
                    yield _event("status", record.model_dump())
                if record.status in FINAL_STATUSES:
                    yield _event("end", {"id": job_id, "status": record.status})
                    return
                try:
                    await asyncio.wait_for(sub.event.wait(), timeout=HEARTBEAT_SECONDS)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    yield ": keep-alive\n\n"
        finally:
            runner.unsubscribe(sub)

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=error_responses(404, 409))
def cancel_job(job_id: str, runner: RunnerDep) -> JobPublic:
    """Cancel a queued job now, or stop a running one after its current iteration (409 if finished)."""
    return runner.cancel(job_id)


@router.get(
    "/{job_id}/params",
    response_class=Response,
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "a .npy file",
            "headers": {
                "X-Job-Status": {
                    "description": "The job's status: failed jobs that saved parameters serve them too.",
                    "schema": {"type": "string", "enum": sorted(FINAL_STATUSES)},
                }
            },
        },
        **error_responses(404, 409),
    },
)
def get_params(job_id: str, runner: RunnerDep) -> Response:
    """The parameters the job ended with, as a ``.npy`` file (``numpy.load`` reads it).

    Served for every finished job that saved them: one that failed after its run (a diverged run, an
    evaluation that failed) too; the ``X-Job-Status`` header says how the job ended. 409 while it is queued
    or running, or if it saved none."""
    data, job_status = runner.params_of(job_id)
    return Response(
        data,
        media_type="application/octet-stream",
        headers={
            "Content-Disposition": f'attachment; filename="{job_id}-params.npy"',
            "X-Job-Status": job_status,
        },
    )


@router.delete("/{job_id}", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(404, 409))
def delete_job(job_id: str, runner: RunnerDep) -> Response:
    """Forget a finished job and what it stored (409 while it is queued or running: cancel it first)."""
    runner.delete(job_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
