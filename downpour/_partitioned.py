"""Downpour with model parallelism, the driver's side: ``downpour.train(..., partitions=K)``.

Every replica of the model is K partition actors (:class:`downpour._partition.PartitionActor`, section 3
of the paper) on the shards aligned to them. :class:`_Supervisor` places and connects them, waits for their
``run``, rebuilds a replica that lost a partition's worker, and checkpoints; its decisions are those of
:class:`downpour._driver.DriverMachine` (as the whole-replica driver's), its parameter-server ops go
through :class:`downpour._shards.Shards` (one checkpoint and recovery path for both).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import xarray as xr
from distributed import Client
from distributed.utils import sync

from distbelief.errors import ClusterError, InvalidOptionError
from distbelief.models import partition_plan
from distbelief.models.internal import PartitionPlan
from distbelief.options import defaults
from distbelief.storage import (
    Dataset,
    ParameterServer,
    ShardMap,
    as_dataset,
    embedded_client,
    partition_layout,
    partition_shards,
    start_vector,
    worker_addresses,
)
from distbelief.storage.internal import (
    DEAD_STATES,
    POLL,
    confirm_dead_async,
    gather_calls,
    run_store,
    start_call,
)

from ._batches import BatchPlan, split_rows
from ._driver import MESSAGES, Abort, Checkpoint, DriverMachine, Poll, Report
from ._options import DownpourOptions, Rule, check_workers, worker_tuple
from ._partition import PartitionActor, PartitionConfig, check_memory
from ._resume import ResumePoint
from ._shards import Shards

__all__ = ["check_partitioned_options", "train_partitioned"]


def train_partitioned(
    model: Any,
    data: Dataset | tuple[np.ndarray, np.ndarray],
    *,
    partitions: int,
    replicas: int = 1,
    rule: Rule = "adagrad",
    lr: float | None = None,
    l2: float = 0.0,
    batch_size: int = 32,
    epochs: int | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    x0: np.ndarray | None = None,
    shuffle: bool = True,
    shards_per_partition: int = 1,
    client: Client | str | None = None,
    store: str | os.PathLike[str] | None = None,
    workers: Sequence[str] | None = None,
    call_timeout: float = 60.0,
    trace: bool = False,
    n_fetch: int | None = None,
    n_push: int | None = None,
    local_lr: float | None = None,
    shard_workers: Sequence[str] | None = None,
    checkpoint_every_s: float = 5.0,
    callback: Callable[[Any], None] | None = None,
    resume: bool = False,
) -> Any:
    """Downpour SGD with ``replicas`` model replicas, each split into ``partitions`` partition actors.

    Called by ``downpour.train(..., partitions=K)``; see the module docstring.

    Parameters
    ----------
    model : models.MLP, models.LocallyConnected or models.LocallyConnected2D
        A model with a partitioned form (``models.partition_plan``).
    data : storage.Dataset or (X, y)
        Training rows.
    partitions : int
        Partitions per replica (K >= 1; partition ``k`` runs on worker ``k % workers``).
    replicas : int
        Model replicas (each owns a contiguous part of the rows).
    rule, lr, l2, batch_size, seed, x0, shuffle, trace
        As in ``downpour.train``.
    epochs, max_steps : int, optional
        Stop after this many epochs of each replica, or this many steps of all replicas together (split
        evenly among them); at least one.
    shards_per_partition : int
        Parameter-server shards per partition (all inside the partition's range).
    client, store
        As in ``downpour.train``.
    workers : list of str, optional
        Worker addresses (default: every worker); partition ``k`` goes to ``workers[k % len(workers)]``
        with its shards (``downpour.train``'s ``replica_workers``). A replica that loses a partition's
        worker is rebuilt on the others (its K partitions go on from the step it reached).
    shard_workers : list of str, optional
        Where the shards go instead (partition ``k``'s to ``shard_workers[k % len(shard_workers)]``).
    checkpoint_every_s : float
        At most this many seconds between checkpoints of the shards to zarr, paced as
        :func:`downpour._resume.checkpoint_interval` says (0: only the initial one; one more is taken at
        the end of the run, also when the callback stops it). A shard lost with its worker is restored from
        the last one on a live worker, and the partitions are handed the new shard map (the updates it
        received since are lost, as in the paper's section 4.1). Each checkpoint carries every replica's
        step count (:func:`downpour._resume.checkpoint_meta`), for ``resume``.
    callback : callable, optional
        Called every ``PROGRESS_EVERY`` seconds with a ``downpour.Progress`` (steps, running mini-batch loss
        and staleness of partition 0 of every live replica, and the ``objective`` at the shards' parameters
        when it is cheap enough, else NaN: see :class:`_Objective`; no held-out metrics, which are NaN).
        Raising ``StopIteration`` stops every partition: ``stop_reason="callback"``. The rows it was called
        with are the result's ``history``.
    resume : bool
        Continue the run whose checkpoints are in ``store`` (which must be given) from its last checkpoint
        (:mod:`downpour._resume`): the shards' parameters, Adagrad accumulators and clocks as they were, and
        every replica's K partitions going on from the replica's step count then (the mini-batches before
        it are skipped, so ``epochs`` and ``max_steps`` count the whole run). A periodic checkpoint's counts
        are read just before it is taken, so a resumed replica may repeat the few steps that were pushed
        in between; the final checkpoint's are exact up to a step a stopped partition had under way.
        ``partitions``, ``replicas`` and the model must be those of the interrupted run.
    call_timeout : float
        Seconds a partition waits for a shard or a peer's message before the run fails.
    n_fetch, n_push, local_lr
        As in ``downpour.train``: every partition of a replica fetches its slice before every
        ``n_fetch``-th step and pushes its accrued gradient after every ``n_push``-th, with local steps
        ``w -= local_lr * g`` in between (``local_lr`` defaults to ``lr``; 0: none). ``n_fetch`` and
        ``n_push`` default as there (:func:`downpour.auto_sync` for the whole model's parameters).

    Returns
    -------
    downpour.TrainResult
        ``x`` in the model's own layout; ``stats`` adds ``partitions``, ``messages_per_step``,
        ``bytes_per_step``, ``messages_by_kind`` (per step), ``per_partition``, ``checkpoints``,
        ``recoveries`` and ``shard_losses`` (``(seconds into the run, shard)`` per restored shard).

    Raises
    ------
    distbelief.errors.InvalidOptionError
        A bad option, a model that cannot be partitioned, or a partition that would not fit in its
        worker's ``memory_limit`` (the message says how many partitions would).

    Examples
    --------
    >>> res = train_partitioned(models.LocallyConnected(64, 10, fields=[5]), (X, y), partitions=2,
    ...                         max_steps=100, rule="sgd", lr=0.1)        # doctest: +SKIP
    >>> res.stats["messages_per_step"]                                    # doctest: +SKIP
    6.0
    """
    if resume and store is None:
        raise InvalidOptionError("resume=True needs the store= of the run to continue")
    plan = partition_plan(model, partitions)
    if epochs is None and max_steps is None:
        raise InvalidOptionError("give epochs or max_steps (a partitioned run needs a known length)")
    # Checked as downpour.train checks them (the options a partitioned run takes).
    opts = DownpourOptions(
        replicas=replicas, rule=rule, lr=lr, l2=l2, batch_size=batch_size, epochs=epochs, max_steps=max_steps,
        seed=seed, shuffle=shuffle, n_fetch=n_fetch, n_push=n_push, local_lr=local_lr,
        checkpoint_every_s=checkpoint_every_s, call_timeout=call_timeout, trace=trace, has_callback=True,
    ).with_sync(model.n_params, windowed=False)  # fmt: skip
    step_lr = opts.step_size
    x_start = start_vector(model, x0, seed)
    layout = partition_layout(plan.bounds, shards_per_partition=shards_per_partition)
    owned = partition_shards(layout, plan.bounds)
    with run_store(store, "downpour-mp-") as store, embedded_client(client) as c:
        known = worker_addresses(c, required=True)
        check_workers("replica_workers", workers, known)
        check_workers("shard_workers", shard_workers, known)
        places = list(workers) if workers else known
        check_memory(c, plan, places)
        dataset = as_dataset(data, store)
        dataset.check_model(model)  # a partition reads its input columns by index: never the wrong ones
        row_ranges = split_rows(dataset.n_rows, replicas)
        per_epoch = [
            BatchPlan.for_rows(dataset, lo, hi, batch_size=batch_size, seed=seed, replica=r).batches_per_epoch
            for r, (lo, hi) in enumerate(row_ranges)
        ]
        limits = []
        for r in range(replicas):
            limit = math.inf if epochs is None else epochs * per_epoch[r]
            if max_steps is not None:
                limit = min(limit, max_steps // replicas + (1 if r < max_steps % replicas else 0))
            limits.append(int(limit))
        homes = list(shard_workers) if shard_workers else places
        shard_places = [homes[k % len(homes)] for k in range(plan.partitions) for _ in owned[k]]
        point = None
        if resume:
            ps, point = Shards.reopen(
                c, store, replicas, model.n_params, workers=shard_places, timeout=call_timeout, layout=layout,
                partitions=plan.partitions,
            )  # fmt: skip
        else:
            ps = Shards.create(
                c, store, replicas, x_start[plan.perm], rule=rule, workers=shard_places, timeout=call_timeout,
                layout=layout, partitions=plan.partitions,
            )  # fmt: skip
        reason = "max_steps" if max_steps is not None and sum(limits) == max_steps else "epochs"
        config = PartitionConfig(
            uuid.uuid4().hex[:12], rule, step_lr, l2, batch_size, seed, shuffle, 0, call_timeout,
            n_fetch=opts.sync[0], n_push=opts.sync[1], local_lr=local_lr,
        )  # fmt: skip
        try:
            run = _Supervisor(
                c, ps, plan, dataset, row_ranges, owned, places, limits, config, checkpoint_every_s, callback,
                resumed=point, objective=_Objective(model, dataset, l2) if callback is not None else None,
            )  # fmt: skip
            return run.result(trace, reason)
        finally:
            ps.close()


class _Objective:
    """``F(w)`` for a partitioned run's progress rows, at the shards' parameters, when it is cheap.

    The partitions hold only their slices and their mini-batch losses, so the objective needs the whole
    vector (one gather from the shards, ``8 n`` bytes) and a pass of the full model over the training rows
    (:func:`downpour._train.objective_sample`, as for whole replicas) in the driver. That is done in a
    thread, and not again before ``BUDGET`` times its last cost has passed, so it takes at most about
    ``1 / BUDGET`` of the driver's time; a model above ``MAX_PARAMS`` parameters (one that needed
    partitioning for its size, whose gather would weigh on the driver) gets NaN.
    """

    #: Parameters above which the objective is not computed while the run goes on.
    MAX_PARAMS = 10_000_000
    #: The objective's cost is kept under ``1 / BUDGET`` of the time between rows.
    BUDGET = 10.0

    def __init__(self, model: Any, dataset: Dataset, l2: float) -> None:
        self.model, self.dataset, self.l2 = model, dataset, l2
        self.rows: tuple[Any, Any] | None = None
        self.next_at = 0.0
        self.enabled = model.n_params <= self.MAX_PARAMS

    def due(self) -> bool:
        """Whether a row taken now should carry the objective."""
        return self.enabled and time.monotonic() >= self.next_at

    def __call__(self, x_perm: np.ndarray, perm: np.ndarray) -> float:
        """F at the partition-major vector ``x_perm`` (``x[perm]``); blocking (run it in a thread)."""
        from distbelief.models import objective

        from ._train import objective_sample

        t0 = time.monotonic()
        if self.rows is None:
            self.rows = objective_sample(self.model, self.dataset)
        x = np.empty_like(x_perm)
        x[perm] = x_perm
        value = float(objective(self.model, x, *self.rows, l2=self.l2)[0])
        self.next_at = time.monotonic() + self.BUDGET * (time.monotonic() - t0)
        return value


#: Times a run may rebuild a replica that lost a partition's worker before the run fails.
MAX_REBUILDS = 8
#: Seconds a stopped partition has to end its ``run`` before its counters are read with ``status``: one
#: blocked sending to a peer on a dead worker would otherwise hold the rebuild for the whole call timeout.
STOP_GRACE = 2.0
#: Seconds a run stopped by its callback gives its partitions to finish the step under way before it
#: aborts the passes still waiting (those of steps a peer will not take).
STOP_SETTLE = 0.3
#: Seconds between two calls of a partitioned run's ``callback``.
PROGRESS_EVERY = 0.2


def _calls_back(callback: Callable[[Any], None], progress: Any) -> bool:
    """``callback(progress)``; whether it raised ``StopIteration`` (which cannot cross a thread's future)."""
    try:
        callback(progress)
    except StopIteration:
        return True
    return False


class _Supervisor:
    """A partitioned run: places every replica's K partitions and connects them, waits for every
    partition's ``run`` (on the client's event loop, :meth:`result`) and rebuilds a replica that lost a
    partition's worker: its surviving partitions are stopped, and K new ones go on from the step the
    survivors reached, on live workers (issue 14, item 4). What the lost partition had not pushed is lost,
    as a lost replica's gradient is in Downpour; the shards count what they applied (``Shard.counters``).

    It also checkpoints the shards every ``checkpoint_every_s`` seconds; a shard lost with its worker is
    restored from the last checkpoint by :class:`storage._calls.ShardRecovery` (as in unpartitioned
    Downpour), every live partition is handed the new shard map, and a replica whose partition failed on
    the lost shard is rebuilt like one that lost a worker. Parameter-server calls block, so they run in a
    thread while the event loop goes on serving the actors."""

    def __init__(
        self,
        client: Client,
        ps: ParameterServer,
        plan: PartitionPlan,
        dataset: Dataset,
        row_ranges: Sequence[tuple[int, int]],
        owned: Sequence[Sequence[int]],
        places: Sequence[str],
        limits: Sequence[int],
        config: PartitionConfig,
        checkpoint_every_s: float,
        callback: Callable[[Any], None] | None = None,
        *,
        resumed: ResumePoint | None = None,
        objective: _Objective | None = None,
    ) -> None:
        self.client, self.plan, self.dataset, self.call_timeout = client, plan, dataset, config.call_timeout
        self.row_ranges, self.owned, self.places = row_ranges, owned, list(places)
        self.configs = [dataclasses.replace(config, step_limit=n) for n in limits]
        self.resumed, self.budget = resumed, self.call_timeout * (1 + max(limits))
        K, shard_map = plan.partitions, ps.shard_map()
        self.futures = [
            [self._submit(r, k, places[k % len(places)], 0, shard_map) for k in range(K)]
            for r in range(len(row_ranges))
        ]
        self.actors = actors = [[f.result() for f in row] for row in self.futures]
        for row in actors:
            calls = [start_call(a, "connect", row) for a in row]
            for ok, value in gather_calls(client, calls, timeout=self.call_timeout):
                if not ok:
                    raise ClusterError(f"a partition could not be connected to its peers: {value!r}")
        elapsed = resumed.time if resumed is not None else 0.0
        starts = [p["steps"] for p in resumed.replicas] if resumed is not None else None
        self.generation = [0] * len(actors)
        self.ps = ps
        #: Its parameter-server ops, checkpoints and restored shards (partitions are repointed after the op).
        self.shards = Shards(ps, lambda: time.monotonic() - self.t0)
        # A resumed run's clock goes on from its checkpoint's (its progress rows continue the earlier ones).
        self.t0 = time.monotonic() - elapsed
        self.started = [time.monotonic()] * len(actors)  # when each replica's current generation started
        #: The step each replica starts from (a resumed run's checkpoint), then its last known count.
        self.steps = list(starts) if starts is not None else [0] * len(actors)
        #: Each replica's step count as its slowest partition last reported it (what checkpoints record).
        self.counted = list(self.steps)
        self.objective = objective
        #: Every Progress the callback was given: the run's history.
        self.rows: list[Any] = []
        self.callback = callback
        #: Its decisions: progress rows, checkpoints, the callback's stop, rebuilds (read at the start of the
        #: run: the tests shorten PROGRESS_EVERY).
        self.machine = DriverMachine(
            replicas=len(actors), start=elapsed, checkpoint_every_s=checkpoint_every_s,
            report_every=PROGRESS_EVERY if callback is not None else math.inf, max_rebuilds=MAX_REBUILDS,
            settle_s=STOP_SETTLE,
        )  # fmt: skip
        self._seen: dict[int, tuple[int, int]] = {}  # replica -> (losses, staleness) already reported

    async def _progress(self) -> None:
        """Call the callback with a :class:`Progress` from every live replica's partition 0; a callback
        that raises ``StopIteration`` stops every partition (the run ends with ``stop_reason="callback"``)."""
        from ._train import Progress

        rows = []
        for r, (row, futs) in enumerate(zip(self.actors, self.futures, strict=True)):
            if futs[0].status in DEAD_STATES:
                continue
            with contextlib.suppress(Exception):
                rows.append((r, await asyncio.wait_for(row[0].status()._result(), self.call_timeout)))
        losses: list[float] = []
        stale: list[int] = []
        for r, st in rows:
            n_loss, n_stale = self._seen.get(r, (0, 0))
            losses += st["losses"][n_loss:]
            stale += st["staleness"][n_stale:]
            self._seen[r] = (len(st["losses"]), len(st["staleness"]))
        for r, st in rows:
            self.steps[r] = max(self.steps[r], int(st["steps"]))
        now = time.monotonic() - self.t0
        value = math.nan
        if self.objective is not None and self.objective.due():
            # The shards' parameters as they are now (the replicas' steps under way land a little later).
            with contextlib.suppress(ClusterError):
                x_perm = await self._ps_call(lambda: self.shards.run(lambda: self.ps.gather("x")))
                value = await asyncio.to_thread(self.objective, x_perm, self.plan.perm)
        progress = Progress(
            time=now, step=sum(self.steps), epoch=math.nan,
            train_loss=float(np.mean(losses)) if losses else math.nan, objective=value, test_loss=math.nan,
            test_accuracy=math.nan, staleness_mean=float(np.mean(stale)) if stale else math.nan,
            staleness_max=float(max(stale)) if stale else math.nan, replicas_alive=len(rows),
        )  # fmt: skip
        self.rows.append(progress)
        assert self.callback is not None  # progress rows are made for it only
        # In a thread: the callback is the user's code (the service writes its metrics to the store in it)
        # and must not hold up this event loop, which every actor call of the process goes through.
        if await asyncio.to_thread(_calls_back, self.callback, progress):
            self.machine.verdict(time.monotonic() - self.t0, callback=True)
            await self._stop_all(self.actors, after_step=True)

    async def _count_steps(self) -> None:
        """Every live replica's step count (the least of its partitions': they step together, one may be a
        step behind) into ``self.steps``; a replica that does not answer keeps its last known count."""
        for r, (row, futs) in enumerate(zip(self.actors, self.futures, strict=True)):
            if any(f.status in DEAD_STATES for f in futs):
                continue
            with contextlib.suppress(Exception):
                counts = await asyncio.gather(
                    *(asyncio.wait_for(a.step_count()._result(), self.call_timeout) for a in row)
                )
                self.counted[r] = min(int(n) for n in counts)

    async def checkpoint(self, *, final: bool = False, steps: Sequence[int] | None = None) -> None:
        """Checkpoint the shards with the replicas' step counts, for ``resume`` (``steps``: the exact
        counts of a run that has ended; otherwise they are read from the partitions just before)."""
        if steps is None:
            await self._count_steps()
            steps = self.counted
        counts = {r: {"steps": int(n)} for r, n in enumerate(steps)}
        now, n, k = time.monotonic() - self.t0, len(self.actors), len(self.actors[0])
        await self._ps_call(lambda: self.shards.checkpoint(now, counts, n, partitions=k, final=final))

    async def _stop_all(self, actors: Sequence[Any], *, after_step: bool = False) -> None:
        """Stop ``actors`` (lists of a replica's partitions) whose workers are alive: at once, aborting the
        passes under way, or (``after_step``) once each has finished the step it is in."""
        calls = [
            asyncio.wait_for((a.finish() if after_step else a.stop())._result(), self.call_timeout)
            for row, futs in zip(actors, self.futures, strict=True)
            for a, f in zip(row, futs, strict=True)
            if f.status not in DEAD_STATES
        ]
        await asyncio.gather(*calls, return_exceptions=True)

    async def _ps_call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (blocking parameter-server ops through ``self.shards``) in a thread; then the partitions
        still alive are handed the new shard map if a shard was restored."""
        before = len(self.shards.shard_losses)
        try:
            return await asyncio.to_thread(fn)
        finally:
            if len(self.shards.shard_losses) > before:
                await self._repoint()

    async def _repoint(self) -> None:
        """Hand every live partition the current shard map (one that cannot be reached is left to fail)."""
        calls = [
            asyncio.wait_for(a.set_shard_map(self.shards.shard_map)._result(), self.call_timeout)
            for row, futs in zip(self.actors, self.futures, strict=True)
            for a, f in zip(row, futs, strict=True)
            if f.status not in DEAD_STATES
        ]
        await asyncio.gather(*calls, return_exceptions=True)

    def run(self) -> tuple[list[dict[str, Any]], list[int]]:
        """Every partition's final counters (stopped generations included) and the replicas rebuilt."""
        loop = self.client.loop
        if loop is None:
            raise ClusterError("the Dask client is closed; connect a client and try again")
        result: tuple[list[dict[str, Any]], list[int]] = sync(loop, self._run)
        return result

    def final_checkpoint(self, steps: Sequence[int]) -> None:
        """The checkpoint at the end of the run (also one the callback stopped), with the exact counts."""
        loop = self.client.loop
        if loop is None:
            raise ClusterError("the Dask client is closed; connect a client and try again")
        sync(loop, functools.partial(self.checkpoint, final=True, steps=steps))

    def _submit(self, r: int, k: int, place: str, generation: int, shard_map: ShardMap) -> Any:
        """Partition ``k`` of replica ``r`` (its ``generation``-th build) on the worker ``place``."""
        lo, hi = self.row_ranges[r]
        return self.client.submit(
            PartitionActor, r, k, self.plan, self.dataset, lo, hi, shard_map, self.owned[k], self.configs[r],
            generation, actor=True, workers=[place], allow_other_workers=False, pure=False,
            key=f"partition-{r}-{k}-{generation}-{self.configs[r].run_id}",
        )  # fmt: skip

    def result(self, trace: bool, stop_reason: str) -> Any:
        """Run the partitions to their end (:meth:`run`), checkpoint, and say what the run did."""
        from ._train import TrainResult

        ps, resumed, row_ranges, K = self.ps, self.resumed, self.row_ranges, self.plan.partitions
        elapsed = resumed.time if resumed is not None else 0.0
        t0 = time.perf_counter()
        statuses, rebuilt = self.run()
        wall = time.perf_counter() - t0
        # Steps count on across a replica's generations (a rebuilt one goes on from the stopped one's count),
        # and a replica's partitions may have stopped a step apart: its count is its slowest partition's.
        reached: dict[tuple[int, int], int] = {}
        for st in statuses:
            key = (st["replica"], st["partition"])
            reached[key] = max(reached.get(key, 0), st["steps"])
        last = {
            r: min(n for (rr, _), n in reached.items() if rr == r) for r in sorted({r for r, _ in reached})
        }
        with contextlib.suppress(ClusterError):  # the previous checkpoint stays current
            self.final_checkpoint([last.get(r, self.counted[r]) for r in range(len(row_ranges))])
        shards = self.shards
        x_perm = shards.run(lambda: ps.gather("x"))
        x = np.empty_like(x_perm)
        x[self.plan.perm] = x_perm
        steps = sum(last.values())
        messages = sum(st["messages"] for st in statuses)
        n_bytes = sum(st["bytes"] for st in statuses)
        by_kind: dict[str, float] = {}
        for st in statuses:
            for kind, count in st["by_kind"].items():
                by_kind[kind] = by_kind.get(kind, 0) + count / max(1, steps)
        staleness = [s for st in statuses for s in st["staleness"]]
        losses = (
            {st["replica"]: np.array(st["losses"]) for st in statuses if st["partition"] == 0}
            if trace
            else {}
        )
        history = _history(self.rows, (elapsed, resumed.step if resumed else 0), (elapsed + wall, steps))
        config = self.configs[0]
        history.attrs.update(
            {"replicas": len(row_ranges), "partitions": K, "rule": config.rule, "lr": config.lr}
        )
        stats = {
            "replicas": len(row_ranges),
            "partitions": K,
            "shards": ps.shards,
            "rebuilt_replicas": rebuilt,
            "shard_counters": shards.run(ps.counters),
            "checkpoints": shards.checkpoints,
            "resumed_from": resumed.step if resumed is not None else None,
            "recoveries": shards.recovery.recoveries,
            "shard_losses": list(shards.shard_losses),
            "pushes": sum(len(st["staleness"]) for st in statuses),
            "staleness_mean": float(np.mean(staleness)) if staleness else math.nan,
            "steps_per_s": steps / wall if wall > 0 else math.nan,
            "messages_per_step": messages / max(1, steps),
            "bytes_per_step": n_bytes / max(1, steps),
            "messages_by_kind": by_kind,
            "per_partition": [
                {k: v for k, v in st.items() if k not in ("losses", "staleness")} for st in statuses
            ],
        }
        if self.machine.stopped == "callback":
            stop_reason = "callback"
        message = MESSAGES[stop_reason]
        if not np.isfinite(x).all():  # no watchdog follows a partitioned run: its end is checked at least
            stop_reason = "diverged"
            message = "diverged: the parameters became NaN or infinite; lower lr, or use rule='adagrad'"
        return TrainResult(
            x=x, history=history, stop_reason=stop_reason, success=stop_reason != "diverged", message=message,
            steps=steps, wall_time=wall, store=ps.url, stats=stats, losses=losses,
        )  # fmt: skip

    def _dead(self, r: int) -> bool:
        return any(f.status in DEAD_STATES for f in self.futures[r])

    async def _run(self) -> tuple[list[dict[str, Any]], list[int]]:
        statuses: list[dict[str, Any]] = []
        tasks: dict[asyncio.Future[Any], tuple[int, int]] = {}

        def start(r: int, step: int) -> None:
            for k, a in enumerate(self.actors[r]):
                task = asyncio.ensure_future(a.run(step)._result())
                task.add_done_callback(lambda f: f.cancelled() or f.exception())
                tasks[task] = (r, k)

        for r in range(len(self.actors)):
            start(r, self.steps[r])
        try:
            return await self._supervise(tasks, statuses, start)
        except BaseException:
            # A run that fails leaves no partition computing: the others would go on training, unseen,
            # until their step limit (their actors are released with the run, not their passes).
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._stop_all(self.actors), self.call_timeout)
            raise

    async def _supervise(
        self,
        tasks: dict[asyncio.Future[Any], tuple[int, int]],
        statuses: list[dict[str, Any]],
        start: Callable[[int, int], None],
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """The supervision loop of :meth:`_run`: progress, checkpoints, lost partitions rebuilt."""
        deadline = time.monotonic() + self.budget
        m = self.machine
        while tasks:
            done, _ = await asyncio.wait(list(tasks), timeout=POLL, return_when=asyncio.FIRST_COMPLETED)
            now = time.monotonic() - self.t0
            for action in m.tick(now, Poll()):
                if isinstance(action, Report):
                    await self._progress()
                elif isinstance(action, Checkpoint):
                    with contextlib.suppress(ClusterError):  # a failed checkpoint leaves the last one current
                        await self.checkpoint()
                    m.checkpointed(now, time.monotonic() - self.t0 - now)
                elif isinstance(action, Abort) and tasks:
                    # A partition that began a step before it was told to stop waits for a peer's message of
                    # a pass the peer (stopped first) will never run: a stop aborts that wait. Not sooner, so
                    # that the steps under way are finished by every partition, not some.
                    await self._stop_all(self.actors)
            broken: set[int] = set()
            errors: dict[int, BaseException] = {}
            for task in done:
                r, k = tasks.pop(task)
                if task.exception() is None:
                    statuses.append(task.result())
                elif m.stopped is not None:
                    # Stopped by the callback, it failed on a peer stopped first: its counters as they are.
                    with contextlib.suppress(Exception):
                        got = await asyncio.wait_for(self.actors[r][k].status()._result(), self.call_timeout)
                        statuses.append({**got, "stopped": True})
                else:
                    broken.add(r)
                    errors.setdefault(r, task.exception())  # type: ignore[arg-type]
            if m.stopped is None:
                broken |= {r for r, _ in tasks.values() if self._dead(r)}
            for r in sorted(broken):
                step = await self._stop(r, tasks, statuses)
                dead = await confirm_dead_async(functools.partial(self._dead, r), ConnectionError())
                # The lost worker may have held shards too (or a partition failed on a lost shard): restore
                # them before the replica is rebuilt, so its new partitions get the new shard map.
                await self._ps_call(self.shards.probe)
                restored = any(self.t0 + t >= self.started[r] for t, _ in self.shards.shard_losses)
                if not dead and not restored:
                    why = errors.get(r)
                    reason = f": {type(why).__name__}: {why}" if why is not None else ""
                    raise ClusterError(
                        f"a partition of replica {r} failed (its worker is alive){reason}"
                    ) from why
                await self._rebuild(r)
                start(r, step)
            if time.monotonic() > deadline:
                raise ClusterError(f"the partitions did not finish within {self.budget:.3g} s")
        return statuses, m.rebuilt

    async def _stop(
        self, r: int, tasks: dict[asyncio.Future[Any], tuple[int, int]], statuses: list[dict[str, Any]]
    ) -> int:
        """Stop replica ``r``'s surviving partitions; the step the replica goes on from."""
        mine = [t for t, (rr, _) in tasks.items() if rr == r]
        stops = [
            (k, asyncio.ensure_future(a.stop()._result()))
            for k, a in enumerate(self.actors[r])
            if self.futures[r][k].status not in DEAD_STATES
        ]
        for _, stop in stops:
            stop.add_done_callback(lambda f: f.cancelled() or f.exception())
        await self._settle(r, stops + [(tasks[t][1], t) for t in mine])
        for _, stop in stops:
            stop.cancel()
        steps = []
        for task in mine:
            tasks.pop(task, None)
            if task.done() and not task.cancelled() and task.exception() is None:
                statuses.append(task.result())
                steps.append(task.result()["steps"])
            else:
                task.cancel()
        for k, a in enumerate(self.actors[r]):
            if self.futures[r][k].status not in DEAD_STATES and not steps:
                with contextlib.suppress(Exception):
                    got = await asyncio.wait_for(a.status()._result(), self.call_timeout)
                    statuses.append({**got, "stopped": True})
                    steps.append(got["steps"])
        return max(steps, default=0)

    async def _settle(self, r: int, waits: list[tuple[int, asyncio.Future[Any]]]) -> None:
        """Wait for ``waits`` (``(k, call)``: calls to replica ``r``'s partition ``k``) to end, but no longer
        than :data:`STOP_GRACE`, nor once partition ``k``'s worker is known dead: a call to a dead worker
        (or a partition's send to a dead peer) can wait the whole call timeout before it fails."""
        deadline = time.monotonic() + min(self.call_timeout, STOP_GRACE)

        def pending() -> list[asyncio.Future[Any]]:
            return [w for k, w in waits if not w.done() and self.futures[r][k].status not in DEAD_STATES]

        while (left := pending()) and time.monotonic() < deadline:
            await asyncio.wait(left, timeout=POLL, return_when=asyncio.FIRST_COMPLETED)

    async def _rebuild(self, r: int) -> None:
        """K new partitions for replica ``r`` on the workers still alive."""
        self.machine.lose(r)  # counts the rebuild; raises past MAX_REBUILDS
        gone = {
            getattr(a, "_address", None)
            for a, f in zip(self.actors[r], self.futures[r], strict=True)
            if f.status in DEAD_STATES
        }
        live = [w for w in self.places if w not in gone]
        if not live:
            raise ClusterError(f"replica {r} lost a partition and no worker is left to rebuild it on")
        self.generation[r] += 1
        g = self.generation[r]
        K = len(self.actors[r])
        old = self.futures[r]
        self.started[r] = time.monotonic()
        self.futures[r] = [
            self._submit(r, k, live[k % len(live)], g, self.shards.shard_map) for k in range(K)
        ]
        self.actors[r] = [await f._result() for f in self.futures[r]]
        await asyncio.gather(*(a.connect(self.actors[r])._result() for a in self.actors[r]))
        for f in old:
            with contextlib.suppress(Exception):
                f.release()


def _history(rows: Sequence[Any], first: tuple[float, int], last: tuple[float, int]) -> xr.Dataset:
    """The run's history: the progress rows the callback was given, between a first and a last row
    ``(time, step)`` (the run's start, or its checkpoint when resumed, and its end).

    Examples
    --------
    >>> _history([], (0.0, 0), (1.5, 40)).step.values.tolist()
    [0, 40]
    """
    times = [first[0], *(float(p.time) for p in rows), last[0]]
    steps = [first[1], *(int(p.step) for p in rows), last[1]]
    columns = ("train_loss", "objective", "staleness_mean", "staleness_max")
    data: dict[str, Any] = {"step": ("time", np.array(steps, dtype=np.int64))}
    for name in columns:
        data[name] = ("time", np.array([math.nan, *(float(getattr(p, name)) for p in rows), math.nan]))
    keep = np.r_[True, np.diff(times) > 0]  # a last row at the time of the last progress row is dropped
    return xr.Dataset(data, coords={"time": np.array(times)}).isel(time=keep)


#: ``downpour.train`` options a partitioned run takes, and the defaults of the ones it does not support.
_SUPPORTED = ("replicas", "rule", "lr", "l2", "batch_size", "epochs", "max_steps", "seed", "x0", "shuffle",
              "client", "store", "trace", "call_timeout", "n_fetch", "n_push", "local_lr",
              "shard_workers", "checkpoint_every_s", "callback", "resume")  # fmt: skip
# staleness_scale's default turns it on for multi-replica SGD elsewhere: partitions run unscaled. The last
# five are taken by downpour.train but not by a partitioned run (it has no history cadence, driver poll, loss
# watchdog, fused messages or key-value communication): refused rather than ignored.
_UNSUPPORTED = ("shards", "warmstart_steps", "time_limit", "compression", "max_coalesce", "deterministic",
                "staleness_scale", "eval_every", "poll_every", "max_loss_growth", "fuse",
                "communication")  # fmt: skip
#: Their defaults, from the options' one definition (and eval_data, a keyword of train() only).
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    **{name: default for name, default in defaults(DownpourOptions).items() if name in _UNSUPPORTED},
    "eval_data": None,
}


def check_partitioned_options(partitions: int, given: dict[str, Any]) -> dict[str, Any]:
    """Refuse the ``downpour.train`` options a partitioned run does not support; the ones it takes.

    ``given`` maps option names to values (``downpour.train``'s locals, or a job's options).

    Raises
    ------
    distbelief.errors.InvalidOptionError
        An option other than its default that partitions do not support, or no ``epochs``/``max_steps``.

    Examples
    --------
    >>> check_partitioned_options(2, {"warmstart_steps": 3})
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: warmstart_steps=3 is not supported with partitions=2; ...
    """
    for name, default in _UNSUPPORTED_DEFAULTS.items():
        if name in given and given[name] is not default and given[name] != default:
            if name == "staleness_scale" and given[name] is False:
                continue  # unscaled is what a partitioned run does
            if name == "communication" and given[name] == "dense":
                continue  # dense is what a partitioned run does
            raise InvalidOptionError(
                f"{name}={given[name]!r} is not supported with partitions={partitions}; leave it at its "
                f"default ({default!r}) or train with partitions=1"
            )
    if given.get("max_staleness") not in (None, 0):
        raise InvalidOptionError(
            f"max_staleness={given['max_staleness']!r} is not supported with partitions={partitions}: every "
            "partition fetches before each step (pass 0 or None)"
        )
    if given.get("epochs") is None and given.get("max_steps") is None:
        raise InvalidOptionError(
            f"give epochs or max_steps with partitions={partitions} (a partitioned run needs a known length)"
        )
    # The options it takes are checked as downpour.train checks them (lr > 0, l2 >= 0, seed >= 0, ...).
    names = {f.name for f in fields(DownpourOptions)} - {"has_callback"}
    checked = {name: given[name] for name in names if name in given}
    for name in ("shard_workers", "replica_workers"):
        checked[name] = worker_tuple(checked.get(name))
    DownpourOptions(**checked, has_callback=True)
    kwargs = {name: given[name] for name in _SUPPORTED if name in given}
    if given.get("replica_workers"):
        kwargs["workers"] = given["replica_workers"]
    if kwargs.get("replicas") is None:
        kwargs.pop("replicas", None)
    return kwargs


def train_from_options(model: Any, data: Any, *, partitions: int, given: dict[str, Any]) -> Any:
    """``downpour.train(..., partitions=K)``: check the options a partitioned run supports, then run it.

    Examples
    --------
    >>> train_from_options(model, data, partitions=2, given={"warmstart_steps": 3})  # doctest: +SKIP
    Traceback (most recent call last):
    distbelief.errors.InvalidOptionError: warmstart_steps=3 is not supported with partitions=2; ...
    """
    kwargs = check_partitioned_options(partitions, given)
    return train_partitioned(model, data, partitions=partitions, **kwargs)
