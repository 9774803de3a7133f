"""The job runner: a queue with a concurrency limit, jobs in a thread pool driving Sandblaster or Downpour.

A job's record, metrics and result live in the store (:mod:`api._jobstore`), so the service can be stopped
at any time: on the next start, finished jobs are all there, queued jobs are queued again, and a job that was
running resumes from its last checkpoint (Sandblaster's ``checkpoint_every`` / ``resume``; Downpour's shard
checkpoints, every ``checkpoint_every_s`` seconds, with ``resume``), or starts over if it had none.

Live state (the metrics rows of running jobs, subscribers to their events) is kept in memory; every change
wakes the server-sent-event streams through :meth:`JobRunner.subscribe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as _dt
import gc
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import dask
import numpy as np
import xarray as xr
from distributed import Client

from distbelief import models
from distbelief.api.schemas import (
    ALGORITHMS,
    FINAL_STATUSES,
    JobCreate,
    JobPublic,
    JobStatus,
    PartitionPublic,
    ReplicaPlacementPublic,
)
from distbelief.api.settings import Settings
from distbelief.errors import DatasetError, DistbeliefError, InvalidOptionError, StoreError
from distbelief.models.internal import BuiltIn
from distbelief.storage import Dataset, resolve_name
from distbelief.storage.internal import normalize_url, task_result

from ._jobstore import JobStore, json_safe

_log = logging.getLogger(__name__)

__all__ = [
    "ANNOTATION",
    "SERVICE_OPTIONS",
    "JobNotFoundError",
    "JobRunner",
    "JobStateError",
    "QueueFullError",
    "RunContext",
    "RunOutcome",
    "Subscription",
    "UnknownDatasetError",
    "downpour_kwargs",
    "run_downpour",
    "run_sandblaster",
]

#: Dask annotation that tags every actor a job creates with the job's id (for ``GET /api/cluster``).
ANNOTATION = "distbelief_job"
#: Seconds between garbage collections while jobs keep finishing (see JobRunner._collect_garbage).
_GC_EVERY = 2.0
#: Held-out / training evaluation at the end of a job reads at most this many values of X.
_EVAL_MAX_VALUES = 100_000_000
#: Seconds the evaluation of a finished job's final loss (a task on a worker) may take.
_EVAL_TIMEOUT = 600.0


class JobNotFoundError(DistbeliefError):
    """No job with that id."""


class JobStateError(DistbeliefError):
    """The job is not in a state that allows the request (e.g. deleting a running job)."""


class QueueFullError(DistbeliefError):
    """The queue holds ``max_queued_jobs`` jobs already."""


class UnknownDatasetError(DatasetError):
    """No dataset of that name (a 422 where a job names it, a 404 at ``GET /api/datasets/{name}``)."""


class DanglingDatasetError(UnknownDatasetError):
    """A registered name whose URL holds no dataset any more (a 409 where a job names it, a 404 at
    ``GET /api/datasets/{name}``)."""


def same_location(url: str) -> str:
    """``url`` in one spelling per place: a local path absolute with its links resolved, a URL without a
    trailing slash, so that two names of one dataset compare equal.

    Examples
    --------
    >>> same_location("file:///tmp/../tmp/d/") == same_location("/tmp/d")
    True
    """
    url = normalize_url(url)
    return url if "://" in url else os.path.realpath(url)


def _now() -> str:
    # Microseconds: jobs are listed newest first by creation time, and two submissions can share a
    # millisecond (the id, a random tie-break, would then order them by chance).
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")


def _close(record: JobPublic, status: JobStatus, message: str | None) -> None:
    """End a job: its final status, the time, and why (called with the job's lock held)."""
    record.status, record.finished_at, record.message = status, _now(), message


# ----------------------------------------------------------------------------------------- adapters


@dataclass
class RunContext:
    """What an algorithm adapter gets to run one job."""

    job_id: str
    algorithm: str
    model: BuiltIn
    data: Dataset
    eval_data: Dataset | None
    options: dict[str, Any]
    client: Client
    store: str
    callback: Callable[[Any], None]
    resume: bool


@dataclass
class RunOutcome:
    """What an algorithm adapter returns: the parameters, the full history and a JSON-able summary."""

    x: np.ndarray
    history: xr.Dataset | None
    summary: dict[str, Any]


#: Arguments of the algorithms that the service sets itself: a job's options never carry them (a user's
#: ``resume`` would clash with the runner's, which says whether the job is taken up after a restart).
SERVICE_OPTIONS = frozenset({"resume", "client", "store", "callback", "eval_data", "method"})


def _user_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A job's options, refusing those the service sets itself (see :data:`SERVICE_OPTIONS`).

    Examples
    --------
    >>> _user_options({"maxiter": 3})
    {'maxiter': 3}
    >>> _user_options({"resume": True})
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: the service sets 'resume' itself; remove it from the options ...
    """
    clash = sorted(SERVICE_OPTIONS.intersection(options))
    if clash:
        named = ", ".join(repr(k) for k in clash)
        raise InvalidOptionError(
            f"the service sets {named} itself; remove it from the options of the job (a job that was "
            "running when the service stopped resumes from its checkpoint by itself)"
        )
    return dict(options)


def downpour_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
    """A ``downpour-sgd`` job's options (JSON, as stored) as the keyword arguments of
    :func:`downpour.train`: ``compression`` ``{"tau": t}`` becomes ``downpour.Compression(tau=t)``.

    Examples
    --------
    >>> downpour_kwargs({"epochs": 2, "compression": {"tau": 0.5}})
    {'epochs': 2, 'compression': Compression(tau=0.5)}
    >>> downpour_kwargs({"compression": 0.5})
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: option compression=0.5 is invalid: expected null ...
    """
    out = dict(options)
    spec = out.get("compression")
    if spec is not None:
        from distbelief.downpour import Compression

        if not isinstance(spec, Mapping) or set(spec) != {"tau"}:
            raise InvalidOptionError(
                f"option compression={spec!r} is invalid: expected null (uncompressed pushes) or "
                '{"tau": ...} with a threshold > 0 (Strom 2015 compressed pushes)'
            )
        out["compression"] = Compression(tau=spec["tau"])
    return out


def run_sandblaster(ctx: RunContext) -> RunOutcome:
    """Run a ``sandblaster-*`` job with :func:`sandblaster.minimize`."""
    from distbelief import sandblaster

    res = sandblaster.minimize(
        ctx.model,
        ctx.data,
        method=ctx.algorithm.removeprefix("sandblaster-"),  # type: ignore[arg-type]
        client=ctx.client,
        store=ctx.store,
        callback=ctx.callback,
        resume=ctx.resume,
        **_user_options(ctx.options),
    )
    summary = _summary(res, "fun", "grad_norm", "nit", "nfev", "success", "status", "message", "stats")
    return RunOutcome(x=res.x, history=res.history, summary=summary)


def run_downpour(ctx: RunContext) -> RunOutcome:
    """Run a ``downpour-sgd`` job with :func:`downpour.train` (the one place that knows its signature)."""
    from distbelief.downpour import train

    options = downpour_kwargs(_user_options(ctx.options))
    # A partitioned run reports its progress (steps, loss, objective; its placement is followed live by
    # JobRunner), can be cancelled through the callback and resumes from its last shard checkpoint; it takes
    # no held-out rows: they are evaluated when it has finished, as for every job.
    held_out: dict[str, Any] = {} if int(options.get("partitions", 1)) > 1 else {"eval_data": ctx.eval_data}
    # A deterministic run does not resume (its shards' push order starts with the run): it starts over, and
    # gives the same parameters as the run it replaces would have.
    res = train(
        ctx.model,
        ctx.data,
        client=ctx.client,
        store=ctx.store,
        callback=ctx.callback,
        resume=ctx.resume and not options.get("deterministic", False),
        **held_out,
        **options,
    )
    summary = _summary(res, "stop_reason", "success", "message", "steps", "wall_time", "stats")
    return RunOutcome(x=np.asarray(res.x, dtype=np.float64), history=res.history, summary=summary)


def _summary(result: Any, *fields: str) -> dict[str, Any]:
    """The named attributes of an algorithm's result, as a job's summary."""
    return {name: getattr(result, name) for name in fields}


def evaluate_rows(model: BuiltIn, x: np.ndarray, datasets: Mapping[str, Dataset | None]) -> dict[str, float]:
    """Mean data loss (and accuracy, for classifiers) of ``x`` on each dataset, read portion by portion.

    Runs as a task on a worker (see :meth:`JobRunner._evaluate`): the rows are read there, never by the
    web process. A dataset of more than ``_EVAL_MAX_VALUES`` values of X is skipped.

    Examples
    --------
    >>> evaluate_rows(model, x, {"train": data, "eval": None})   # doctest: +SKIP
    {'train_loss': 0.31, 'train_accuracy': 0.9}
    """
    out: dict[str, float] = {}
    for prefix, ds in datasets.items():
        if ds is None or ds.n_rows * ds.n_features > _EVAL_MAX_VALUES:
            continue
        loss = correct = 0.0
        for _, X, y in ds.iter_portions():
            loss += float(model.loss_and_grad(x, X, y)[0])
            if model.n_classes is not None:
                correct += float(np.sum(model.predict(x, X) == y))
        out[f"{prefix}_loss"] = loss / ds.n_rows
        if model.n_classes is not None:
            out[f"{prefix}_accuracy"] = correct / ds.n_rows
    return out


_ADAPTERS: dict[str, Callable[[RunContext], RunOutcome]] = {
    name: run_downpour if name == "downpour-sgd" else run_sandblaster for name in ALGORITHMS
}


def _row_of(record: Any) -> dict[str, float]:
    """The numeric scalar fields of a callback's record: a dataclass (Sandblaster's ``IterationRecord``,
    Downpour's ``Progress``)."""
    items = dataclasses.asdict(record).items()
    return {
        str(k): float(v) for k, v in items if isinstance(v, bool | int | float | np.integer | np.floating)
    }


def _history_rows(history: xr.Dataset, index: str) -> tuple[list[str], list[list[float]]] | None:
    """An algorithm's history as ``(columns, rows)``: one row per entry, indexed by the integer variable or
    coordinate ``index``, the first column (Sandblaster's ``iteration``, Downpour's ``step``).

    Only variables along the history's main dimension are kept (Downpour's per-shard counters are not).
    """
    if index not in history.variables or history[index].ndim != 1:
        return None
    dim = history[index].dims[0]
    names = [
        str(k)
        for k, v in history.variables.items()
        if k != index and v.dims == (dim,) and (np.issubdtype(v.dtype, np.number) or v.dtype == bool)
    ]
    values = [np.asarray(history[k].values, dtype=np.float64) for k in (index, *names)]
    return [index, *names], np.column_stack(values).tolist()


# ----------------------------------------------------------------------------------------- the runner


@dataclass(eq=False)
class Subscription:
    """A waiter on a job's changes, woken from the job's thread on the subscriber's event loop."""

    job_id: str
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Job:
    # The job as GET /api/jobs/{id} shows it, kept up to date under ``lock`` and saved as its job.json: the
    # record and the public model have the same fields, so one model is both (no second list of them).
    record: JobPublic
    dim: str = "iteration"
    columns: list[str] = field(default_factory=list)
    rows: list[list[float]] | None = None  # None: not in memory (read the store)
    generation: int = 0  # bumped whenever rows are replaced rather than appended to
    resume: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    cancel: threading.Event = field(default_factory=threading.Event)
    last_flush: float = 0.0
    dirty_metrics: bool = False
    stopped: bool = False  # the callback stopped the run (cancel or shutdown)
    model: BuiltIn | None = None  # built once from record.model (see JobRunner._model)

    @classmethod
    def of(cls, record: JobPublic, **kwargs: Any) -> _Job:
        # Metrics rows are indexed by Sandblaster's iterations or Downpour's steps.
        return cls(record=record, dim="step" if record.algorithm == "downpour-sgd" else "iteration", **kwargs)


@dataclass
class Snapshot:
    """A consistent view of a job for one server-sent-events step."""

    record: JobPublic
    dim: str
    columns: list[str]
    rows: list[list[float]]
    total: int
    generation: int


class JobRunner:
    """Runs jobs on a Dask client, at most ``settings.max_concurrent_jobs`` at a time.

    Parameters
    ----------
    settings : Settings
        Limits (``max_concurrent_jobs``, ``max_queued_jobs``, ``checkpoint_every``, ...).
    store : JobStore
        Where records, metrics and results are kept.
    client : distributed.Client
        The cluster the jobs run on.

    Examples
    --------
    >>> runner = JobRunner(settings, JobStore(settings.store), client)   # doctest: +SKIP
    >>> runner.start()                                                   # doctest: +SKIP
    >>> job = runner.submit(JobCreate.model_validate(body))              # doctest: +SKIP
    >>> runner.stop()                                                    # doctest: +SKIP
    """

    def __init__(self, settings: Settings, store: JobStore, client: Client) -> None:
        self.settings = settings
        self.store = store
        self.client = client
        self._jobs: dict[str, _Job] = {}
        self._jobs_lock = threading.Lock()
        self._subs: dict[str, set[Subscription]] = {}
        self._subs_lock = threading.Lock()
        self._stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=settings.max_concurrent_jobs, thread_name_prefix="job")
        self._running: set[str] = set()
        self._last_gc = 0.0
        self._refrozen = False
        #: Set by the app when it froze the objects of its imports (create_app): only then does the runner
        #: freeze more, once, after the first job (see _collect_garbage).
        self.freeze_after_first_job = False
        # Opened datasets by name, with the store's datasets_version they were opened at: a submission
        # opens its dataset twice (admission, then the checks of submit), and opening one costs several
        # round trips through zarr's IO thread, which under load is most of a submission's latency.
        self._datasets: dict[str, tuple[int, Dataset]] = {}
        self._datasets_lock = threading.Lock()
        #: Jobs whose records were unusable, set aside at start: id -> (folder, reason).
        self._aside: dict[str, tuple[str, str]] = {}

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Load every job from the store; queue again what was queued, resume what was running."""
        records = sorted(self.store.load_records(), key=lambda r: r.created_at)
        self._aside = self.store.set_aside_jobs()
        for record in records:
            job = _Job.of(record)
            if record.status == "running":
                try:
                    self._recover(job)
                except Exception as exc:  # one job that cannot be taken up must not keep the service down
                    why = f"the server restarted and could not take this job up again: {exc}"
                    _close(record, "failed", why)
                    with contextlib.suppress(Exception):
                        self.store.save_record(record)
            with self._jobs_lock:
                self._jobs[record.id] = job
            if record.status == "queued":
                self._pool.submit(self._execute, record.id)

    def _recover(self, job: _Job) -> None:
        """A job the previous server left running: resume it from its last checkpoint, or start it again."""
        rec = job.record
        rec.restarts += 1
        point = self._checkpoint_of(job)
        rec.status = "queued"
        if point is not None:
            rec.resumed_from, last_row, where = point
            job.resume = True
            rec.message = f"the server restarted; resuming from the checkpoint {where}"
            with contextlib.suppress(StoreError):  # unreadable metrics: the resumed run writes new ones
                stored = self.store.load_metrics(rec.id)
                if stored is not None:
                    job.dim, job.columns, rows = stored
                    job.rows = [r for r in rows if r[0] <= last_row]
        else:
            rec.iterations, rec.latest = 0, {}
            rec.message = (
                "the server restarted before the job's first checkpoint; running it again from the start"
            )
        self.store.save_record(rec)

    def _checkpoint_of(self, job: _Job) -> tuple[int, float, str] | None:
        """Where a job left running would resume: ``(resumed_from, last metrics row kept, in words)``.

        Sandblaster: the checkpoint iteration the record holds. Downpour: the last shard checkpoint in the
        job's run directory (its step count; metrics rows, indexed by step, are kept up to it).
        """
        rec = job.record
        if rec.algorithm == "downpour-sgd":
            from distbelief.downpour.internal import resume_point

            point = resume_point(self.store.run_dir(rec.id))
            if point is None:
                return None
            return point.step, float(point.step), f"at step {point.step} ({point.time:.3g} s into the run)"
        k = rec.checkpoint_iteration
        return None if not k else (k, float(k), f"of iteration {k}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking jobs; ask running jobs to stop at their next iteration and save what they have.

        Jobs stay ``running`` (or ``queued``) in the store, so the next :meth:`start` takes them up again.
        """
        self._stopping.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        while self._running and time.monotonic() < deadline:
            time.sleep(0.05)
        for job in list(self._jobs.values()):
            if job.dirty_metrics:
                self._flush(job, force=True)

    # -- queries ------------------------------------------------------------------------------------
    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            aside = self._aside.get(job_id)
            if aside is not None:
                raise JobNotFoundError(
                    f"job {job_id}'s record was unusable ({aside[1]}), so it was set aside when the service "
                    f"started; DELETE /api/jobs/{job_id} removes what it stored"
                )
            raise JobNotFoundError(f"no job with id {job_id!r}; list the jobs with GET /api/jobs")
        return job

    def get(self, job_id: str) -> JobPublic:
        """A copy of the job's record."""
        job = self._job(job_id)
        with job.lock:
            return job.record.model_copy()

    def find(self, job_id: str) -> JobPublic | None:
        """A copy of the job's record, or None if there is no such job (:meth:`get` raises then)."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        with job.lock:
            return job.record.model_copy()

    def list_jobs(
        self, *, status: str | None = None, limit: int = 50, offset: int = 0
    ) -> tuple[list[JobPublic], int]:
        """Jobs (newest first) with the given status, one page of them, and how many match."""
        with self._jobs_lock:
            jobs = list(self._jobs.values())
        records = []
        for job in jobs:
            with job.lock:
                if status is None or job.record.status == status:
                    records.append(job.record.model_copy())
        records.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        return records[offset : offset + limit], len(records)

    def queued(self) -> int:
        """How many jobs are queued."""
        return sum(1 for job in list(self._jobs.values()) if job.record.status == "queued")

    def running_ids(self) -> list[str]:
        """Ids of the jobs running now."""
        with self._jobs_lock:
            return sorted(self._running)

    def metrics(self, job_id: str) -> tuple[str, list[str], list[list[float]]]:
        """``(dim, columns, rows)`` of a job's metrics: from memory while it runs, else from the store."""
        job = self._job(job_id)
        with job.lock:
            if job.rows is not None:
                return job.dim, list(job.columns), [list(r) for r in job.rows]
        return self.store.load_metrics(job_id) or (job.dim, [job.dim], [])  # (none stored: no rows)

    def params_of(self, job_id: str) -> tuple[bytes, str]:
        """The ``.npy`` bytes of the parameters a finished job saved, and the job's status.

        A job that failed after its run (its evaluation, or a diverged Downpour run) saved parameters too:
        they are served like those of a job that succeeded; the status says which it was.

        Raises
        ------
        JobStateError
            The job is queued or running, or it ended without saving parameters.
        """
        record = self.get(job_id)
        status = record.status
        if status not in FINAL_STATUSES:
            raise JobStateError(
                f"job {job_id} is {status}: parameters are available once it has finished (wait for it, "
                f"or cancel it: POST /api/jobs/{job_id}/cancel)"
            )
        data = self.store.load_params_bytes(job_id)
        if data is None:
            raise JobStateError(
                f"job {job_id} is {status} and saved no parameters"
                + (f" ({record.message})" if record.message else "")
            )
        return data, status

    def snapshot(self, job_id: str, cursor: int, generation: int) -> Snapshot:
        """The record and the metrics rows after ``cursor`` (all rows if ``generation`` is stale)."""
        job = self._job(job_id)
        with job.lock:
            record, gen, live = job.record.model_copy(), job.generation, job.rows
            start = cursor if generation == gen else 0
            if live is not None:
                return Snapshot(record, job.dim, list(job.columns), live[start:], len(live), gen)
        dim, columns, rows = self.metrics(job_id)
        return Snapshot(record, dim, columns, rows[start:], len(rows), gen)

    # -- events -------------------------------------------------------------------------------------
    def subscribe(self, job_id: str) -> Subscription:
        """Register the calling event loop to be woken on every change of the job."""
        self._job(job_id)
        sub = Subscription(job_id, asyncio.get_running_loop())
        with self._subs_lock:
            self._subs.setdefault(job_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Forget a subscription."""
        with self._subs_lock:
            subs = self._subs.get(sub.job_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.job_id]

    def _notify(self, job_id: str) -> None:
        with self._subs_lock:
            subs = list(self._subs.get(job_id, ()))
        for sub in subs:
            with contextlib.suppress(RuntimeError):  # the subscriber's loop has closed
                sub.loop.call_soon_threadsafe(sub.event.set)

    # -- datasets -----------------------------------------------------------------------------------
    def open_dataset(self, name: str) -> Dataset:
        """The dataset called ``name`` (uploaded into the store, or registered by URL).

        Opened once per version of the store's datasets (:attr:`JobStore.datasets_version`, bumped by every
        upload, deletion and registration through the service) and kept: a ``Dataset`` is immutable once
        written and safe to share between threads.
        """
        version = self.store.datasets_version  # read first: a change during the open makes the entry stale
        with self._datasets_lock:
            hit = self._datasets.get(name)
        # A hit is used while its data is still there: a folder removed behind the service's back (or a
        # registered URL emptied) must not be taken for a dataset (one quick read of its metadata).
        if hit is not None and hit[0] == version and Dataset.exists(hit[1].url):
            return hit[1]
        link = self.store.links().get(name)
        if link is not None:
            if not Dataset.exists(link):
                raise DanglingDatasetError(
                    f"dataset {name!r} is registered at {self.store.shown(link)}, which holds no dataset any "
                    f"more (deleted or moved?); register it again, or forget it (DELETE /api/datasets/{name})"
                )
            data = Dataset.open(link)
        else:
            path = resolve_name(self.store.datasets_root, name)
            if not Dataset.exists(path):
                known = self.dataset_names()
                hint = f"known datasets: {', '.join(known)}" if known else "there are none yet"
                raise UnknownDatasetError(
                    f"no dataset named {name!r}; upload it first (POST /api/datasets) — {hint}"
                )
            data = Dataset.open(path)
        with self._datasets_lock:
            if any(v != version for v, _ in self._datasets.values()):
                self._datasets.clear()  # stale entries go at once: the cache holds one version's names
            self._datasets[name] = (version, data)
        return data

    def dataset_names(self) -> list[str]:
        """Names of every dataset (uploaded and registered)."""
        from distbelief.storage.internal import list_datasets

        return sorted(set(list_datasets(self.store.datasets_root)) | set(self.store.links()))

    def dataset_location(self, name: str, links: Mapping[str, str] | None = None) -> str:
        """Where the dataset ``name`` lives (see :func:`same_location`): its registered URL, or its folder
        in the store; whether or not anything is there."""
        links = self.store.links() if links is None else links
        url = links.get(name)
        return same_location(url if url is not None else resolve_name(self.store.datasets_root, name))

    def jobs_using(self, name: str) -> list[str]:
        """Ids of queued or running jobs that read the dataset ``name``, under that name or any other that
        names the same location (a dataset registered by URL as an alias of an uploaded one)."""
        links = self.store.links()
        where = self.dataset_location(name, links)
        out = []
        for job in list(self._jobs.values()):
            rec = job.record
            if rec.status not in ("queued", "running"):
                continue
            names = {n for n in (rec.dataset, rec.eval_dataset) if n is not None}
            if name in names or any(self.dataset_location(n, links) == where for n in names):
                out.append(rec.id)
        return out

    # -- commands -----------------------------------------------------------------------------------
    def submit(self, create: JobCreate) -> JobPublic:
        """Check a job against its data and the algorithm's options, store it, and queue it.

        Raises
        ------
        distbelief.errors.DatasetError
            A dataset is missing, or does not fit the model (feature count, labels).
        distbelief.errors.InvalidOptionError
            The algorithm refuses an option.
        QueueFullError
            ``max_queued_jobs`` jobs are waiting already.
        """
        if self._stopping.is_set():
            raise QueueFullError("the server is shutting down; submit the job again once it is back")
        _user_options(create.options)  # a JobCreate built without validation may carry them
        model = models.from_spec(create.model)
        data = self.open_dataset(create.dataset)
        data.check_model(model)
        if create.eval_dataset is not None:
            self.open_dataset(create.eval_dataset).check_model(model)
        options = dict(create.options)
        if create.algorithm.startswith("sandblaster-"):
            options.setdefault("checkpoint_every", self.settings.checkpoint_every)
            from distbelief import sandblaster

            # The algorithm's own checks, now rather than when the job starts.
            sandblaster.SandblasterOptions(
                method=create.algorithm.removeprefix("sandblaster-"),  # type: ignore[arg-type]
                **options,
            )
        else:
            with contextlib.suppress(ImportError, AttributeError):  # no Downpour: the job fails, saying so
                from distbelief import downpour

                downpour.DownpourOptions(**downpour_kwargs(options), has_callback=True)
                if options.get("replicas") is not None:  # every replica needs rows of its own
                    downpour.split_rows(data.n_rows, int(options["replicas"]))
        queued = self.queued()
        if queued >= self.settings.max_queued_jobs:
            raise QueueFullError(
                f"{queued} jobs are queued already (the limit is DISTBELIEF_MAX_QUEUED_JOBS="
                f"{self.settings.max_queued_jobs}); wait for some to finish or cancel some"
            )
        # The fields left out (started_at, result, restarts, ...) start at JobPublic's defaults.
        record = JobPublic(
            **create.model_dump(include={"name", "algorithm", "dataset", "eval_dataset"}),
            id=uuid.uuid4().hex[:16],
            model=model.spec,
            options=options,
            status="queued",
            created_at=_now(),
            max_iterations=options.get("maxiter", options.get("max_steps")),
        )
        job = _Job.of(record, rows=[], model=model)
        self.store.save_record(record)
        with self._jobs_lock:
            self._jobs[record.id] = job
        self._pool.submit(self._execute, record.id)
        return record.model_copy()

    def cancel(self, job_id: str) -> JobPublic:
        """Cancel a queued job at once, or ask a running one to stop after its current iteration."""
        job = self._job(job_id)
        with job.lock:
            status = job.record.status
            if status in FINAL_STATUSES:
                raise JobStateError(f"job {job_id} is {status} already; there is nothing to cancel")
            job.cancel.set()
            job.record.cancel_requested = True
            if status == "queued":
                _close(job.record, "cancelled", "cancelled while queued")
        self._persist(job)
        self._notify(job_id)
        return self.get(job_id)

    def delete(self, job_id: str) -> None:
        """Forget a finished job (or one set aside for its unusable record) and everything it stored."""
        aside = self._aside.pop(job_id, None)
        if aside is not None and job_id not in self._jobs:
            self.store.delete_set_aside(aside[0])
            return
        job = self._job(job_id)
        with job.lock:
            status = job.record.status
            if status not in FINAL_STATUSES:
                raise JobStateError(
                    f"job {job_id} is {status}; cancel it first (POST /api/jobs/{job_id}/cancel)"
                )
            with self._jobs_lock:
                self._jobs.pop(job_id, None)
        with job.io_lock:
            self.store.delete_job(job_id)

    # -- running a job ------------------------------------------------------------------------------
    def _persist(self, job: _Job) -> None:
        with job.io_lock:
            with job.lock:
                record = job.record.model_copy()
            if record.id in self._jobs:
                self.store.save_record(record)

    def _flush(self, job: _Job, *, force: bool = False) -> None:
        """Write the job's metrics and record, at most once per ``metrics_flush_seconds`` unless forced."""
        now = time.monotonic()
        if not force and now - job.last_flush < self.settings.metrics_flush_seconds:
            return
        job.last_flush = now
        with job.io_lock:
            with job.lock:
                rows = [list(r) for r in job.rows] if job.rows is not None else None
                columns, dim = list(job.columns), job.dim
                record = job.record.model_copy()
                job.dirty_metrics = False
            if record.id not in self._jobs:
                return
            if rows is not None and columns:
                self.store.save_metrics(record.id, dim, columns, rows)
            self.store.save_record(record)

    def _add_row(self, job: _Job, record: Any, checkpoint_every: int) -> bool:
        """Append a callback's record to the job's metrics; whether the run has just checkpointed."""
        row = _row_of(record)
        with job.lock:
            rows = job.rows if job.rows is not None else []
            job.rows = rows
            index = row.pop(job.dim, rows[-1][0] + 1 if rows else 0.0)
            if not job.columns:
                job.columns = [job.dim]
            for k in row:
                if k not in job.columns:  # a new metric: the earlier rows lack it
                    job.columns.append(k)
                    for r in rows:
                        r.append(math.nan)
            if rows and rows[-1][0] >= index:
                # A resumed run repeats the iterations after its checkpoint: the new rows replace them.
                while rows and rows[-1][0] >= index:
                    rows.pop()
                job.generation += 1
            rows.append([index] + [row.get(c, math.nan) for c in job.columns[1:]])
            rec = job.record
            rec.iterations = int(index)
            rec.latest = _latest(job.columns, rows[-1])
            job.dirty_metrics = True
            if checkpoint_every and job.dim == "iteration" and int(index) % checkpoint_every == 0:
                # The coordinator writes a due checkpoint before it calls back, so this one exists now.
                rec.checkpoint_iteration = int(index)
                return True
            return False

    def _callback(self, job: _Job, checkpoint_every: int) -> Callable[[Any], None]:
        def callback(record: Any) -> None:
            checkpointed = self._add_row(job, record, checkpoint_every)
            self._notify(job.record.id)
            # A new checkpoint is saved in the record at once: a restart resumes from what the record says.
            self._flush(job, force=checkpointed)
            if job.cancel.is_set() or self._stopping.is_set():
                job.stopped = True
                raise StopIteration

        return callback

    def _execute(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is None or self._stopping.is_set():
            return
        with job.lock:
            if job.record.status != "queued":
                return  # cancelled while it waited
            job.record.status = "running"
            job.record.started_at = job.record.started_at or _now()
            if job.rows is None:
                job.rows = []
            # The record says "running" now (persisted below); metrics follow metrics_flush_seconds later,
            # so a job shorter than that writes them once, at its end (each write is a zarr group).
            job.last_flush = time.monotonic()
        with self._jobs_lock:
            self._running.add(job_id)
        self._persist(job)
        self._notify(job_id)
        try:
            self._run(job)
        finally:
            with job.lock:
                final = job.record.status in FINAL_STATUSES
            self._flush(job, force=True)
            # Only once the record is written: stop() waits for the running jobs, and a job that ended just
            # before a shutdown must not be taken up as "running" (and run again) on the next start.
            with self._jobs_lock:
                self._running.discard(job_id)
            if final:
                with job.lock:
                    job.rows = None  # the store has them; keep memory bounded
            self._notify(job_id)
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Free the actors of finished jobs.

        Every call to a Dask actor leaves a reference cycle that holds the actor's handle (a closure in
        distributed's ``Actor.__getattr__`` that refers to itself), and a handle keeps its actor, with the
        job's parameter vectors, alive on the workers until the garbage collector breaks the cycle. A full
        collection costs ~0.1 s here, so it runs when the last running job ends, else at most every
        ``_GC_EVERY`` seconds.
        """
        with self._jobs_lock:
            idle = not self._running
            due = time.monotonic() - self._last_gc >= _GC_EVERY
            if not (idle or due):
                return
            self._last_gc = time.monotonic()
            # The first job imports the algorithms' modules (sandblaster, numba, dask.array, ...): tens of
            # thousands of objects that live as long as the process and that every later collection would
            # walk, holding the GIL (~10-30 ms each, a stall of every request). Once the runner is idle for
            # the first time (no job running or queued, so no job's objects are alive), move them out of the
            # collector's sight as the app did with the imports at its start (see create_app).
            refreeze = idle and not self._refrozen and self.freeze_after_first_job and not self.queued()
            if refreeze:
                self._refrozen = True
        gc.collect()
        if refreeze:
            with self._jobs_lock:
                # Again: a job submitted during the collection must not have its objects frozen with the rest.
                still_idle = not self._running and not self.queued()
                if not still_idle:
                    self._refrozen = False  # the next idle moment then
            if still_idle:
                gc.freeze()

    @staticmethod
    def _model(job: _Job) -> BuiltIn:
        """The job's model, built from its spec once (at submission, or on its first run after a restart)."""
        if job.model is None:
            job.model = models.from_spec(job.record.model)
        return job.model

    def _run(self, job: _Job) -> None:
        rec = job.record
        job_id = rec.id
        resume = job.resume
        try:
            model = self._model(job)
            data = self.open_dataset(rec.dataset)
            eval_data = self.open_dataset(rec.eval_dataset) if rec.eval_dataset else None
            options = dict(rec.options)
            ctx = RunContext(
                job_id=job_id,
                algorithm=rec.algorithm,
                model=model,
                data=data,
                eval_data=eval_data,
                options=options,
                client=self.client,
                store=self.store.run_dir(job_id),
                callback=self._callback(job, int(options.get("checkpoint_every") or 0)),
                resume=resume,
            )
            # Every actor the run creates carries the job's id, so GET /api/cluster can tell whose it is.
            watch = self._watch_placement(job) if int(options.get("partitions", 1)) > 1 else None
            try:
                with dask.annotate(**{ANNOTATION: job_id}):
                    outcome = _ADAPTERS[rec.algorithm](ctx)
            finally:
                if watch is not None:
                    watch.set()
        except Exception as exc:
            if self._stopping.is_set():
                return  # the server is going down: the job stays "running" and is taken up on restart
            reason = str(exc) or type(exc).__name__
            if resume:
                reason = f"could not resume from the checkpoint of {job.dim} {rec.resumed_from}: {reason}"
            if not isinstance(exc, DistbeliefError | ValueError):
                reason = f"{type(exc).__name__}: {reason}"
                # Not an error the user can act on: the traceback is for whoever runs the service.
                _log.error("job %s failed", job_id, exc_info=exc)
            with job.lock:
                if job.cancel.is_set():
                    # A cancel answered 200 is kept: the job ends cancelled (the failure said beside it).
                    reason = f"cancelled while running; the run had failed: {reason}"
                _close(rec, "cancelled" if job.cancel.is_set() else "failed", reason)
            return
        job.resume = False
        if job.stopped and not job.cancel.is_set():
            return  # stopped for a shutdown: the job stays "running" and resumes on the next start
        try:
            self._finish(job, outcome, model, data, eval_data)
        except Exception as exc:
            reason = f"the run ended but its results could not be saved: {type(exc).__name__}: {exc}"
            with job.lock:
                _close(rec, "cancelled" if job.cancel.is_set() else "failed", reason)

    def _finish(
        self, job: _Job, outcome: RunOutcome, model: BuiltIn, data: Dataset, eval_data: Dataset | None
    ) -> None:
        """Save the parameters, evaluate the result, keep the full history as the metrics, close the job.

        The parameters are saved first: an evaluation that fails (its task lost, or over its time limit)
        fails the job with a message that says so, and the parameters the run paid for stay available.
        """
        rec = job.record
        self.store.save_params(rec.id, outcome.x)
        summary = dict(outcome.summary)
        evaluation_failed = None
        try:
            summary.update(self._evaluate(model, outcome.x, data, eval_data))
        except Exception as exc:
            evaluation_failed = (
                f"the run ended and its parameters are saved (GET /api/jobs/{rec.id}/params), but the "
                f"evaluation of its final loss failed: {type(exc).__name__}: {exc}"
            )
        summary.update(_objective_of(summary, outcome.x, rec.options))
        if outcome.history is not None:
            found = _history_rows(outcome.history, job.dim)
            if found is not None and found[1]:
                columns, rows = found
                with job.lock:
                    # A resumed run's history starts at its checkpoint: the rows before it stay.
                    at = {c: i for i, c in enumerate(job.columns)}
                    kept = [
                        [r[at[c]] if c in at else math.nan for c in columns]
                        for r in (job.rows or [])
                        if r[0] < rows[0][0]
                    ]
                    job.columns, job.rows = columns, kept + rows
                    job.generation += 1
                    rec.iterations = int(rows[-1][0])
                    rec.latest = _latest(job.columns, job.rows[-1])
        placement = placement_of_stats(summary.get("stats"))
        with job.lock:
            if placement:
                rec.placement = placement
            rec.result = json_safe(summary)
            # Cancel is atomic: cancel() answers 200 only while the job is not final, under this lock, so a
            # cancel that came too late for the run's callback to see (the run ended meanwhile) counts here.
            if job.stopped or job.cancel.is_set():
                failed = f"; {evaluation_failed}" if evaluation_failed is not None else ""
                _close(rec, "cancelled", f"cancelled while running{failed}")
            elif evaluation_failed is not None:
                _close(rec, "failed", evaluation_failed)
            else:
                # A diverged Downpour run is a failed job (its message says what to change); its history and
                # parameters are kept for a look at what went wrong.
                diverged = summary.get("stop_reason") == "diverged"
                _close(rec, "failed" if diverged else "succeeded", summary.get("message"))

    def _evaluate(
        self, model: BuiltIn, x: np.ndarray, data: Dataset, eval_data: Dataset | None
    ) -> dict[str, Any]:
        """:func:`evaluate_rows` of the training and held-out rows, as a task on a worker."""
        task = self.client.submit(
            evaluate_rows,
            model,
            x,
            {"train": data, "eval": eval_data},
            pure=False,
            key=f"evaluate-{uuid.uuid4().hex}",
        )
        result: dict[str, Any] = task_result(
            task, timeout=_EVAL_TIMEOUT, what="the evaluation of the final loss"
        )
        return result

    def _watch_placement(self, job: _Job, every: float = 0.5) -> threading.Event:
        """Follow where a partitioned job's partition actors are (``record.placement``) until the
        returned event is set: the dashboard draws every replica as its group of partitions and workers."""
        done = threading.Event()
        job_id = job.record.id

        def follow() -> None:
            seen: list[ReplicaPlacementPublic] | None = None
            while not done.wait(every) and not self._stopping.is_set():
                try:
                    mine = [a for a in self.actors() if a["job_id"] == job_id and a["kind"] == "partition"]
                except Exception:  # the scheduler is away for a moment: try again
                    continue
                placement = placement_of_actors(mine)
                if placement and placement != seen:
                    seen = placement
                    with job.lock:
                        if done.is_set():
                            return  # the run has ended: its final placement (with counters) is the record's
                        job.record.placement = placement
                    self._notify(job_id)

        threading.Thread(target=follow, name=f"placement-{job_id}", daemon=True).start()
        return done

    # -- cluster ------------------------------------------------------------------------------------
    def actors(self) -> list[dict[str, Any]]:
        """Every shard and replica actor on the cluster, with its worker, state and job."""

        # Defined here so that it travels to the scheduler by value: the scheduler need not have distbelief.
        def actor_table(dask_scheduler: Any, annotation: str) -> list[dict[str, Any]]:
            out = []
            for key, ts in dask_scheduler.tasks.items():
                name = str(key)
                parts = name.split("-")
                # Shards are keyed shard-<i>-<uuid>, partitions partition-<replica>-<k>-<run>; replicas by
                # their class name.
                if len(parts) > 1 and parts[0] in ("shard", "partition"):
                    kind = parts[0]
                else:
                    kind = "replica" if "replica" in name.lower() else ""
                if not getattr(ts, "actor", False) or not kind:
                    continue
                holders = list(getattr(ts, "who_has", None) or ())
                on = holders[0] if holders else ts.processing_on
                job = (ts.annotations or {}).get(annotation)
                row = {
                    "key": name,
                    "kind": kind,
                    "worker": on and on.address,
                    "state": ts.state,
                    "job_id": job,
                }
                if kind == "partition" and len(parts) >= 3 and parts[1].isdigit() and parts[2].isdigit():
                    row.update(replica=int(parts[1]), partition=int(parts[2]))
                out.append(row)
            return out

        return list(self.client.run_on_scheduler(actor_table, annotation=ANNOTATION))


def placement_of_actors(actors: list[dict[str, Any]]) -> list[ReplicaPlacementPublic]:
    """Partition actors (rows of :meth:`JobRunner.actors`) as replicas, each the group of its partitions in
    order; a row's other keys than ``PartitionPublic``'s are left out, rows of no partition skipped.

    Examples
    --------
    >>> [g.model_dump(exclude_none=True) for g in placement_of_actors([
    ...     {"replica": 0, "partition": 1, "worker": "tcp://b"}, {"replica": 0, "partition": 0, "worker": "tcp://a"}])]
    [{'replica': 0, 'partitions': [{'partition': 0, 'worker': 'tcp://a'}, {'partition': 1, 'worker': 'tcp://b'}]}]
    """
    by_replica: dict[int, list[PartitionPublic]] = {}
    for row in actors:
        if row.get("replica") is not None and row.get("partition") is not None:
            by_replica.setdefault(int(row["replica"]), []).append(PartitionPublic.model_validate(row))
    return [
        ReplicaPlacementPublic(replica=r, partitions=sorted(parts, key=lambda p: p.partition))
        for r, parts in sorted(by_replica.items())
    ]


def placement_of_stats(stats: Any) -> list[ReplicaPlacementPublic] | None:
    """A finished partitioned run's ``stats["per_partition"]`` as replicas, each a group of partitions with
    its worker, steps and traffic (None for a run without partitions).

    Examples
    --------
    >>> placement_of_stats({"per_partition": [{"replica": 0, "partition": 0, "worker": "tcp://a", "steps": 3,
    ...     "messages": 6, "bytes": 480, "param_bytes": 800}]})[0].partitions[0].messages
    6
    """
    if not isinstance(stats, dict) or not isinstance(stats.get("per_partition"), list):
        return None
    return placement_of_actors(stats["per_partition"])


def _objective_of(summary: dict[str, Any], x: np.ndarray, options: dict[str, Any]) -> dict[str, float]:
    """``objective``: F(w) on the training data for every algorithm, as Sandblaster defines it,
    ``train_loss + (l2/2)||x||^2 + l1 ||x||_1`` (Sandblaster's own ``fun`` where the data was too large to
    evaluate).

    Examples
    --------
    >>> _objective_of({"train_loss": 0.5}, np.array([1.0, 1.0]), {"l2": 0.1})
    {'objective': 0.6}
    >>> _objective_of({"train_loss": 0.5}, np.array([1.0, -1.0]), {"l2": 0.1, "l1": 0.25})
    {'objective': 1.1}
    """
    if "train_loss" in summary:
        l2, l1 = float(options.get("l2") or 0.0), float(options.get("l1") or 0.0)
        penalty = 0.5 * l2 * float(np.dot(x, x)) + l1 * float(np.abs(x).sum())
        return {"objective": float(summary["train_loss"]) + penalty}
    if "fun" in summary:
        return {"objective": float(summary["fun"])}
    return {}


def _latest(columns: list[str], row: list[float]) -> dict[str, float | None]:
    return {c: (v if math.isfinite(v) else None) for c, v in zip(columns, row, strict=True)}
