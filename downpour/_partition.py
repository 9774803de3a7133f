"""Downpour with model parallelism: R replicas x K partitions, each partition a Dask actor (section 3, 4.1).

Every replica of the model is split into K partitions (``models.partition_plan``); partition ``k`` of every
replica is an actor on worker ``k % workers``, holding only its parameter slice. Partitions exchange
activations and input-gradients directly, actor to actor (``async def`` methods only: a partition awaits
its peers' messages on the event loop and computes its blocks in a thread, so no synchronous method ever
waits on another actor; DESIGN.md, "deadlock"). The parameter-server shards are aligned to the partitions
(:func:`storage.partition_layout`), so partition ``k`` fetches from and pushes to only its own shards
(Figure 2): the parameter vector on the shards is the partition-major ``w[plan.perm]``.

Each partition of a replica steps through the same mini-batches (the replica's :class:`BatchPlan`, known to
every partition from the seed: no message). A step is: fetch its slice, run its pass, push its slice of
``g / n + l2 * w``. A replica's next fetch goes out after its push was answered, so with one replica this is
sequential mini-batch SGD (or Adagrad) exactly; with several, the replicas stay asynchronous.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from distributed import Client

from distbelief.errors import InvalidOptionError
from distbelief.models.internal import PartitionPlan
from distbelief.storage import Dataset, ShardMap, axpy, keep_loop_responsive, reuse_freed_memory
from distbelief.storage.internal import KEEP_FREE_BYTES, PartitionPeer, PassAborted, current_worker, kernels

from ._batches import BatchPlan

__all__ = [
    "COPIES_PER_PARAM",
    "PartitionActor",
    "PartitionConfig",
    "check_memory",
    "memory_needed",
    "take_step",
]

#: Float64 copies of its parameter slice a partition costs a worker: the shard's vector and Adagrad
#: accumulator, the partition's fetched copy and its gradient.
COPIES_PER_PARAM = 4


@dataclass(frozen=True)
class PartitionConfig:
    """The run's options a partition needs (built by ``downpour._partitioned.PartitionedReplicas``).

    Examples
    --------
    >>> PartitionConfig("run", "sgd", 0.1, 0.0, 32, 0, True, 10, 30.0).rule
    'sgd'
    """

    run_id: str
    rule: str
    lr: float
    l2: float
    batch_size: int
    seed: int
    shuffle: bool
    step_limit: int
    call_timeout: float
    n_fetch: int = 1
    n_push: int = 1
    local_lr: float | None = None


def _step_loop(
    grad: np.ndarray, n: float, l2: float, w: np.ndarray, acc: np.ndarray, first: bool, a: float
) -> None:  # pragma: no cover - compiled
    for i in range(grad.size):
        v = grad[i] / n
        if l2 != 0.0:
            v = v + l2 * w[i]
        if first:
            acc[i] = v
        else:
            acc[i] = acc[i] + v
        if a != 0.0:
            w[i] = w[i] + a * v


def take_step(
    grad: np.ndarray, n: int, l2: float, w: np.ndarray, acc: np.ndarray, first: bool, a: float
) -> None:
    """A partition's step on its slice: ``g = grad / n + l2 * w``, then ``acc = g`` (``first``) or
    ``acc += g``, and ``w += a * g`` (the local step; none when ``a`` is 0), with ``w`` read before it moves.

    One compiled pass over the four vectors (numba, when there is) where numpy takes four and a temporary:
    on the 2.8e6-parameter slice of the benchmark's image model, a pass over 22 MB vectors per operation
    was a tenth of a step. Rounds as ``np.divide``, then :func:`storage.axpy` calls, do (no FMA).

    Examples
    --------
    >>> grad, w, acc = np.array([4.0, 8.0]), np.array([1.0, 1.0]), np.zeros(2)
    >>> take_step(grad, 2, 0.5, w, acc, True, -0.1); acc, w
    (array([2.5, 4.5]), array([0.75, 0.55]))
    """
    loop = kernels.compiled(_step_loop)
    if loop is not None and all(v.flags.c_contiguous and v.dtype == np.float64 for v in (grad, w, acc)):
        loop(grad, float(n), float(l2), w, acc, bool(first), float(a))
        return
    g = np.divide(grad, n)
    if l2:
        axpy(l2, w, g)
    if first:
        acc[...] = g
    else:
        axpy(1.0, g, acc)
    if a:
        axpy(a, g, w)


def _heap_fits(plan: PartitionPlan) -> bool:
    """Whether this worker can afford to keep freed memory for reuse (``storage.reuse_freed_memory``, up to
    ``KEEP_FREE_BYTES``) beside a partition of ``plan``: no memory_limit, or the partition's copies and that
    much freed memory within half of it. A model split *because* it is large for its workers (the benchmark's
    memory case) would otherwise push them past Dask's pause and restart thresholds.
    """
    worker = current_worker()
    manager = getattr(worker, "memory_manager", None)
    limit = getattr(manager, "memory_limit", None)
    return not limit or memory_needed(plan) + KEEP_FREE_BYTES <= limit / 2


class PartitionActor(PartitionPeer):
    """Dask actor: partition ``k`` of replica ``replica``, training on rows ``[lo, hi)``.

    Parameters
    ----------
    replica, k : int
        Replica and partition numbers.
    plan : models.MLPPlan or models.LocallyConnectedPlan
        The partitioned model.
    dataset : storage.Dataset
        Training rows (the partition reads only its input columns of its replica's rows).
    lo, hi : int
        The replica's rows.
    shard_map : storage.ShardMap
        The parameter server; the partition talks only to ``shards`` (inside its own range).
    shards : list of int
        This partition's shards.
    config : PartitionConfig
        The run's options.
    generation : int
        How many times this replica was rebuilt before (its pushes' source name has it).

    Examples
    --------
    >>> fut = client.submit(PartitionActor, 0, 1, plan, ds, 0, ds.n_rows, ps.shard_map(), [1], config,
    ...                     actor=True)                                   # doctest: +SKIP
    """

    ALGORITHM = "downpour"

    def __init__(
        self,
        replica: int,
        k: int,
        plan: PartitionPlan,
        dataset: Dataset,
        lo: int,
        hi: int,
        shard_map: ShardMap,
        shards: Sequence[int],
        config: PartitionConfig,
        generation: int = 0,
    ) -> None:
        super().__init__(replica, k, call_timeout=config.call_timeout)
        self.plan, self.dataset, self.config = plan, dataset, config
        self.batches = BatchPlan.for_rows(
            dataset, lo, hi, batch_size=config.batch_size, seed=config.seed, replica=replica,
            shuffle=config.shuffle,
        )  # fmt: skip
        self.map = shard_map
        self.shards = list(shards)
        self.columns = plan.input_columns(k)
        self.losses: list[float] = []
        self.steps = 0
        self.pushes_sent = 0
        # The driver's poll reads these scalars (:meth:`counters`), not the lists: rows are counted from the
        # replica's first step (skipped ones too: a rebuilt or resumed replica's count goes on), the loss and
        # staleness totals over this partition's life, ``stale_max`` since the last poll.
        self.rows = 0
        self.loss_sum = 0.0
        self.fetches = 0
        self.stale_max = self.stale_sum = self.stale_count = 0
        self.versions = [0] * len(self.shards)
        # "update": the step on the slice (take_step and a fetch's own-writes correction); "data": reading
        # and gathering the mini-batch. What a step costs besides its pass and the parameter server.
        self.seconds.update({"fetch": 0.0, "push": 0.0, "update": 0.0, "data": 0.0})
        self._segments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # A rebuilt replica's partitions push under a name of their own: their sequence numbers restart.
        self._source = f"{config.run_id}/replica-{replica}/partition-{k}/generation-{generation}"
        self.generation = generation
        self.applied = 0
        self._stopped = False
        self._hard_stop = False
        # The fetched slice lands in this buffer, allocated once (a fresh 20+ MB vector per fetch is page
        # faults on every step with n_fetch = 1).
        self._w: np.ndarray | None = None
        self._grad: np.ndarray | None = None  # every pass's gradient, written in place
        if _heap_fits(plan):
            # Gradients and activations of a large partition are blocks of 1-64 MB allocated and freed
            # every step: from the heap, reused, rather than fresh mmap'ed pages (as a replica's).
            reuse_freed_memory()
        # A peer's halo must not wait for Python's 5 ms forced switch while this partition's compute thread
        # runs its many short numpy calls (as sandblaster's partitions do; storage.keep_loop_responsive).
        keep_loop_responsive()
        # Import numba and load (or compile) the step's loop now, not in the first step: ~0.5-1 s a worker
        # process pays once, which the run's steps would otherwise carry.
        take_step(np.zeros(1), 1, 0.0, np.zeros(1), np.zeros(1), True, 0.0)

    def _segment(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        if s not in self._segments:
            lo, hi = self.batches.segments[s]
            X, y = self.dataset.read_rows(lo, hi)
            self._segments[s] = (np.ascontiguousarray(X[:, self.columns]), y)
        return self._segments[s]

    async def _fetch(self) -> tuple[np.ndarray, list[int]]:
        t0 = time.perf_counter()
        parts = await asyncio.gather(
            *(self.map.ask(i, "fetch", ["x"], timeout=self.config.call_timeout) for i in self.shards)
        )
        arrays = [np.asarray(p[1][0], dtype=np.float64) for p in parts]
        n = sum(a.size for a in arrays)
        if self._w is None or self._w.size != n:
            self._w = np.empty(n)
        # Copied, never kept: a shard on this worker may answer with its own vector (no serialization).
        np.concatenate(arrays, out=self._w)
        self.seconds["fetch"] += time.perf_counter() - t0
        self.fetches += 1
        self.versions = [int(p[0]) for p in parts]
        return self._w, list(self.versions)

    async def _push(self, accrued: np.ndarray, steps: int, versions: list[int]) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        answers = await asyncio.gather(
            *(
                self.map.ask(
                    i,
                    "push",
                    accrued[lo - self.base : hi - self.base],
                    source=self._source,
                    seq=self.pushes_sent,
                    rule=cfg.rule,
                    lr=cfg.lr,
                    fetched_version=v,
                    steps=steps,
                    timeout=cfg.call_timeout,
                )
                for i, v, (lo, hi) in zip(self.shards, versions, self._ranges, strict=True)
            )
        )
        self.pushes_sent += 1
        self.seconds["push"] += time.perf_counter() - t0
        stale = [int(a[2]) for a in answers]
        self.stale_count += len(stale)
        self.stale_sum += sum(stale)
        self.stale_max = max(self.stale_max, max(stale, default=0))
        self.applied += sum(bool(a[0]) for a in answers)

    async def set_shard_map(self, shard_map: ShardMap) -> None:
        """Use ``shard_map`` from the next fetch on (a lost shard was restored on another worker)."""
        self.map = shard_map

    async def stop(self) -> None:
        """Stop training at the next step (the replica lost a partition): passes under way are aborted."""
        self._stopped = self._hard_stop = True
        self.abort_all()

    async def finish(self) -> None:
        """Stop training after the step under way (the run was stopped): a pass under way goes on, and
        what the partition accrued since its last push is pushed. A partition that started a pass its
        peers will not run waits in it until :meth:`stop` aborts it; so every partition of a replica ends
        with the same step count, and the shards hold exactly those steps (what a resume relies on)."""
        self._stopped = True

    async def run(self, start: int = 0) -> dict[str, Any]:
        """Train until ``step_limit`` steps; the partition's counters.

        The paper's replica loop (section 4.1, Algorithm 7.1) on this partition's slice, one step at a time:
        fetch before every ``n_fetch``-th step, take the local step ``w -= local_lr * g``, push the gradient
        accrued since the last push after every ``n_push``-th (and what is left at the end). A fetch lands
        as the fetched slice *minus the local steps not pushed yet* (the shards cannot hold those), so one
        replica with ``rule="sgd"`` and ``local_lr = lr`` is sequential mini-batch SGD whatever
        ``n_fetch`` and ``n_push`` are. Every partition of a replica fetches and pushes at the same steps.

        ``start``: a rebuilt replica goes on from this step (the mini-batches before it are skipped). A
        stopped partition (:meth:`stop`) returns its counters with ``stopped=True``.
        """
        try:
            return await self._train(start)
        except PassAborted:
            if not self._stopped:
                raise
            return self.status_now()

    async def _train(self, start: int) -> dict[str, Any]:
        cfg = self.config
        local_lr = cfg.lr if cfg.local_lr is None else cfg.local_lr
        epoch = 0
        w_k = np.zeros(0)
        versions: list[int] = []
        accrued: np.ndarray | None = None
        accrued_steps = 0
        skip = self.steps = start
        while self.steps < cfg.step_limit and not self._stopped:
            for s, rows in self.batches.epoch(epoch):
                if skip:
                    skip -= 1
                    self.rows += len(rows)
                    continue
                if self.steps >= cfg.step_limit or self._stopped:
                    break
                if self.steps % cfg.n_fetch == 0 or w_k.size == 0:
                    w_k, versions = await self._fetch()
                    if accrued is not None and local_lr:
                        t0 = time.perf_counter()
                        axpy(-local_lr, accrued, w_k)  # read your own writes: the local steps not pushed yet
                        self.seconds["update"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                X_seg, y_seg = self._segment(s)
                X_k, y = X_seg[rows], y_seg[rows]
                self.seconds["data"] += time.perf_counter() - t0
                out = None
                if cfg.n_push > 1:  # the gradients of the steps between pushes go through one buffer
                    if self._grad is None or self._grad.size != w_k.size:
                        self._grad = np.empty(w_k.size)
                    out = self._grad
                gen = self.plan.partition_pass(self.k, w_k, X_k, y, out=out)
                loss, grad = await self.run_pass(self.steps, gen)
                n = len(rows)
                self.rows += n
                if loss is not None:
                    self.losses.append(float(loss) / n)
                    self.loss_sum += float(loss)
                first = accrued is None
                if accrued is None:
                    # A new vector per push, not a reused one: the push's message may still hold the last.
                    # With n_push = 1 it is the pass's own new gradient, scaled in place: the slice's
                    # copies on the worker stay COPIES_PER_PARAM.
                    accrued = grad if out is None else np.empty(w_k.size)
                # The local step, replaced by the next fetch when n_fetch = 1.
                local = local_lr if local_lr and (cfg.n_fetch > 1 or cfg.n_push > 1) else 0.0
                t0 = time.perf_counter()
                take_step(grad, n, cfg.l2, w_k, accrued, first, -local)
                self.seconds["update"] += time.perf_counter() - t0
                accrued_steps += 1
                self.steps += 1
                if self.steps % cfg.n_push == 0:
                    await self._push(accrued, accrued_steps, versions)
                    accrued, accrued_steps = None, 0
            epoch += 1
        if accrued is not None and not self._hard_stop:
            await self._push(accrued, accrued_steps, versions)  # the last steps' gradient
        return self.status_now()

    @property
    def _ranges(self) -> list[tuple[int, int]]:
        return [self.map.layout.ranges()[i] for i in self.shards]

    @property
    def base(self) -> int:
        """Where this partition's range starts in the partition-major vector."""
        return self._ranges[0][0]

    def status_now(self) -> dict[str, Any]:
        """Counters: steps, messages and bytes sent, losses (partition 0), staleness, time split."""
        return {
            **self._scalars(),
            "losses": list(self.losses),
            "seconds": dict(self.seconds),
            "by_kind": dict(self.by_kind),
            "worker": getattr(current_worker(), "address", None),  # where it runs (the dashboard's groups)
        }

    def _scalars(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "partition": self.k,
            "generation": self.generation,
            "stopped": self._stopped,
            "applied": self.applied,
            "shard_ids": list(self.shards),
            "steps": self.steps,
            "messages": self.messages,
            "bytes": self.bytes,
            "param_bytes": 8 * sum(hi - lo for lo, hi in self._ranges),
            "rows": self.rows,
            "loss_sum": self.loss_sum,
            "pushes_sent": self.pushes_sent,
            "fetches": self.fetches,
            "staleness_sum": self.stale_sum,
            "staleness_count": self.stale_count,
            "staleness_max": self.stale_max,
            "versions": list(self.versions),
        }

    async def counters(self) -> dict[str, Any]:
        """The scalars of :meth:`status_now` (no per-step lists), for the driver's poll; ``staleness_max``
        is the largest since the previous call."""
        out = self._scalars()
        self.stale_max = 0
        return out

    async def status(self) -> dict[str, Any]:
        """:meth:`status_now`, as an actor call."""
        return self.status_now()


def memory_needed(plan: PartitionPlan) -> int:
    """Bytes the largest partition's parameters cost its worker (``COPIES_PER_PARAM`` float64 copies).

    Examples
    --------
    >>> from distbelief import models
    >>> memory_needed(models.partition_plan(models.MLP([4, 2]), 1))  # 10 parameters
    320
    """
    widest = max(b - a for a, b in zip(plan.bounds[:-1], plan.bounds[1:], strict=True))
    return 8 * COPIES_PER_PARAM * widest


def check_memory(client: Client, plan: PartitionPlan, workers: Sequence[str]) -> None:
    """Refuse a plan whose largest partition would not fit in a worker's ``memory_limit``.

    Raises
    ------
    distbelief.errors.InvalidOptionError
        The message says how many partitions would fit.

    Examples
    --------
    >>> check_memory(client, models.partition_plan(models.MLP([4, 2]), 1), workers)  # doctest: +SKIP
    """
    info = (
        client.scheduler_info(n_workers=-1)["workers"]
        if _takes_n_workers(client)
        else client.scheduler_info()["workers"]
    )
    limits = [int(info[w].get("memory_limit") or 0) for w in workers if w in info]
    limit = min((x for x in limits if x > 0), default=0)
    need = memory_needed(plan)
    if limit and need > limit:
        k = plan.partitions
        fits = math.ceil(k * need / limit)
        raise InvalidOptionError(
            f"a partition of this model needs about {need / 2**20:.1f} MiB on its worker ({COPIES_PER_PARAM} "
            f"copies of its {need // (8 * COPIES_PER_PARAM)} parameters) but a worker's memory_limit is "
            f"{limit / 2**20:.1f} MiB; split the model into partitions={fits} or more (model parallelism), "
            "or give the workers more memory"
        )


def _takes_n_workers(client: Client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters
