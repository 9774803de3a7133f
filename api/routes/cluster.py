"""``GET /api/cluster``: the scheduler, its workers, and the shards and replicas that jobs placed on them."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter, Request

from distbelief.api.deps import RunnerDep, SettingsDep
from distbelief.api.schemas import ActorPublic, ClusterPublic, WorkerPublic
from distbelief.storage import scheduler_identity

from .._http import error_responses

__all__ = ["router"]

router = APIRouter(prefix="/cluster", tags=["cluster"], responses=error_responses(401, 503))


@router.get("", response_model=ClusterPublic)
def cluster_state(request: Request, runner: RunnerDep, settings: SettingsDep) -> ClusterPublic:
    """Workers (threads, memory, actors held) and every parameter-server shard and model replica."""
    backend = request.app.state.backend
    info = scheduler_identity(runner.client)
    actors = [ActorPublic(**a) for a in runner.actors()]
    per_worker = Counter(a.worker for a in actors if a.worker)
    workers = [
        WorkerPublic(
            address=address,
            name=str(w.get("name", address)),
            nthreads=int(w.get("nthreads", 0)),
            memory_limit=w.get("memory_limit"),
            actors=per_worker.get(address, 0),
        )
        for address, w in sorted(info.get("workers", {}).items())
    ]
    return ClusterPublic(
        scheduler=str(info.get("address", "")),
        embedded=backend.embedded,
        dashboard_url=backend.dashboard_url,
        workers=workers,
        actors=sorted(actors, key=lambda a: (a.job_id or "", a.kind, a.key)),
        running_jobs=runner.running_ids(),
        queued_jobs=runner.queued(),
        max_concurrent_jobs=settings.max_concurrent_jobs,
    )
