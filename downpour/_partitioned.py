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
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr
from distributed import Client

from distbelief.downpour._batches import BatchPlan, split_rows
from distbelief.errors import ClusterError, InvalidOptionError
from distbelief.models._partitioned import PartitionPlan, Recv, Send, Traffic, partition_plan
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
from distbelief.storage._calls import gather_calls, start_call
from distbelief.storage._server import _current_worker

__all__ = ["PartitionActor", "PartitionConfig", "memory_needed", "train_partitioned"]

#: Float64 copies of its parameter slice a partition costs a worker: the shard's vector and Adagrad
#: accumulator, the partition's fetched copy and its gradient.
COPIES_PER_PARAM = 4


@dataclass(frozen=True)
class PartitionConfig:
    """The run's options a partition needs (built by :func:`train_partitioned`).

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


async def _call(actor: Any, method: str, *args: Any) -> Any:
    """Call ``method`` on another actor from an event loop; in-process when it lives on this worker."""
    worker = _current_worker()
    if worker is not None and getattr(actor, "_address", None) == worker.address:
        local = worker.state.actors.get(actor.key)
        if local is not None:
            return await getattr(local, method)(*args)
    return await getattr(actor, method)(*args)


def _advance(gen: Any, value: Any) -> tuple[bool, Any]:
    """``(False, next op)`` or ``(True, the pass's result)``: a StopIteration cannot cross a Future."""
    try:
        return False, gen.send(value)
    except StopIteration as stop:
        return True, stop.value


class PartitionActor:
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

    Examples
    --------
    >>> fut = client.submit(PartitionActor, 0, 1, plan, ds, 0, ds.n_rows, ps.shard_map(), [1], config,
    ...                     actor=True)                                   # doctest: +SKIP
    """

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
    ) -> None:
        self.replica, self.k, self.plan, self.dataset, self.config = replica, k, plan, dataset, config
        self.batches = BatchPlan.for_rows(
            dataset, lo, hi, batch_size=config.batch_size, seed=config.seed, replica=replica,
            shuffle=config.shuffle,
        )  # fmt: skip
        self.map = shard_map
        self.shards = list(shards)
        self.peers: list[Any] = []
        self.columns = plan.input_columns(k)
        self.mailbox: dict[tuple[int, str, int], asyncio.Future[np.ndarray]] = {}
        self.traffic = Traffic()
        self.losses: list[float] = []
        self.steps = 0
        self.staleness: list[int] = []
        self.seconds = {"fetch": 0.0, "compute": 0.0, "wait": 0.0, "push": 0.0}
        self._segments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._source = f"{config.run_id}/replica-{replica}/partition-{k}"

    async def connect(self, peers: list[Any]) -> None:
        """The K partition actors of this replica (itself included), by partition number."""
        self.peers = list(peers)

    def _slot(self, src: int, tag: str, step: int) -> asyncio.Future[np.ndarray]:
        key = (src, tag, step)
        fut = self.mailbox.get(key)
        if fut is None:
            fut = self.mailbox[key] = asyncio.get_running_loop().create_future()
        return fut

    async def deliver(self, src: int, tag: str, step: int, array: np.ndarray) -> None:
        """A message from partition ``src`` (never waits: it only fills the mailbox)."""
        self._slot(src, tag, step).set_result(array)

    def _segment(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        if s not in self._segments:
            lo, hi = self.batches.segments[s]
            X, y = self.dataset.read_rows(lo, hi)
            self._segments[s] = (np.ascontiguousarray(X[:, self.columns]), y)
        return self._segments[s]

    async def _pass(
        self, step: int, w_k: np.ndarray, X_k: np.ndarray, y: np.ndarray
    ) -> tuple[Any, np.ndarray]:
        gen = self.plan.partition_pass(self.k, w_k, X_k, y)
        value: np.ndarray | None = None
        timeout = self.config.call_timeout
        while True:
            t0 = time.perf_counter()
            done, op = await asyncio.to_thread(_advance, gen, value)
            if done:
                self.seconds["compute"] += time.perf_counter() - t0
                result: tuple[Any, np.ndarray] = op
                return result
            t1 = time.perf_counter()
            self.seconds["compute"] += t1 - t0
            if isinstance(op, Send):
                self.traffic.add(op)
                await asyncio.wait_for(
                    _call(self.peers[op.dest], "deliver", self.k, op.tag, step, op.array), timeout
                )
                value = None
            else:
                assert isinstance(op, Recv)
                try:
                    value = await asyncio.wait_for(self._slot(op.src, op.tag, step), timeout)
                except TimeoutError:
                    raise ClusterError(
                        f"partition {self.k} of replica {self.replica} waited {timeout:g} s for {op.tag!r} "
                        f"from partition {op.src}; its worker may have died (restart the run from the shards)"
                    ) from None
                del self.mailbox[(op.src, op.tag, step)]
            self.seconds["wait"] += time.perf_counter() - t1

    async def run(self) -> dict[str, Any]:
        """Train until ``step_limit`` steps; the partition's counters."""
        cfg = self.config
        epoch = 0
        while self.steps < cfg.step_limit:
            for s, rows in self.batches.epoch(epoch):
                if self.steps >= cfg.step_limit:
                    break
                t0 = time.perf_counter()
                parts = await asyncio.gather(
                    *(self.map.ask(i, "fetch", ["x"], timeout=cfg.call_timeout) for i in self.shards)
                )
                versions = [int(p[0]) for p in parts]
                w_k = np.concatenate([p[1][0] for p in parts])
                self.seconds["fetch"] += time.perf_counter() - t0
                X_seg, y_seg = self._segment(s)
                X_k, y = X_seg[rows], y_seg[rows]
                loss, grad = await self._pass(self.steps, w_k, X_k, y)
                n = len(rows)
                g = grad / n
                if cfg.l2:
                    g += cfg.l2 * w_k
                if loss is not None:
                    self.losses.append(float(loss) / n)
                t0 = time.perf_counter()
                answers = await asyncio.gather(
                    *(
                        self.map.ask(
                            i,
                            "push",
                            g[lo - self.base : hi - self.base],
                            source=self._source,
                            seq=self.steps,
                            rule=cfg.rule,
                            lr=cfg.lr,
                            fetched_version=v,
                            timeout=cfg.call_timeout,
                        )
                        for i, v, (lo, hi) in zip(self.shards, versions, self._ranges, strict=True)
                    )
                )
                self.seconds["push"] += time.perf_counter() - t0
                self.staleness += [int(a[2]) for a in answers]
                self.steps += 1
            epoch += 1
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
            "replica": self.replica,
            "partition": self.k,
            "steps": self.steps,
            "messages": self.traffic.messages,
            "bytes": self.traffic.bytes,
            "by_kind": dict(self.traffic.by_kind),
            "losses": list(self.losses),
            "staleness": list(self.staleness),
            "seconds": dict(self.seconds),
            "param_bytes": 8 * sum(hi - lo for lo, hi in self._ranges),
        }

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


def _check_memory(client: Client, plan: PartitionPlan, workers: Sequence[str]) -> None:
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


def train_partitioned(
    model: Any,
    data: Dataset | tuple[np.ndarray, np.ndarray],
    *,
    partitions: int,
    replicas: int = 1,
    rule: str = "adagrad",
    lr: float | None = None,
    l2: float = 0.0,
    batch_size: int = 32,
    epochs: int | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    x0: np.ndarray | None = None,
    shuffle: bool = True,
    shards_per_partition: int = 1,
    client: Client | None = None,
    store: str | os.PathLike[str] | None = None,
    workers: Sequence[str] | None = None,
    call_timeout: float = 60.0,
    trace: bool = False,
) -> Any:
    """Downpour SGD with ``replicas`` model replicas, each split into ``partitions`` partition actors.

    Called by ``downpour.train(..., partitions=K)``; see the module docstring.

    Parameters
    ----------
    model : models.MLP or models.LocallyConnected
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
        with its shards.
    call_timeout : float
        Seconds a partition waits for a shard or a peer's message before the run fails.

    Returns
    -------
    downpour.TrainResult
        ``x`` in the model's own layout; ``stats`` adds ``partitions``, ``messages_per_step``,
        ``bytes_per_step``, ``messages_by_kind`` (per step) and ``per_partition``.

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
    from distbelief.downpour._train import TrainResult

    plan = partition_plan(model, partitions)
    if rule not in ("sgd", "adagrad"):
        raise InvalidOptionError(f"unknown update rule {rule!r}; use 'sgd' or 'adagrad'")
    if epochs is None and max_steps is None:
        raise InvalidOptionError("give epochs or max_steps (a partitioned run needs a known length)")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InvalidOptionError(f"replicas must be a positive integer, got {replicas!r}")
    step_lr = lr if lr is not None else (0.1 if rule == "sgd" else 0.2)
    x_start = start_vector(model, x0, seed)
    layout = partition_layout(plan.bounds, shards_per_partition=shards_per_partition)
    owned = partition_shards(layout, plan.bounds)
    tmp = None
    if store is None:
        tmp = tempfile.TemporaryDirectory(prefix="downpour-mp-")
        store = tmp.name
    store = str(store)
    try:
        with embedded_client(client) as c:
            places = list(workers) if workers else worker_addresses(c, required=True)
            _check_memory(c, plan, places)
            dataset = as_dataset(data, store)
            row_ranges = split_rows(dataset.n_rows, replicas)
            per_epoch = [
                BatchPlan.for_rows(
                    dataset, lo, hi, batch_size=batch_size, seed=seed, replica=r
                ).batches_per_epoch
                for r, (lo, hi) in enumerate(row_ranges)
            ]
            limits = []
            for r in range(replicas):
                limit = math.inf if epochs is None else epochs * per_epoch[r]
                if max_steps is not None:
                    limit = min(limit, max_steps // replicas + (1 if r < max_steps % replicas else 0))
                limits.append(int(limit))
            shard_places = [places[k % len(places)] for k in range(plan.partitions) for _ in owned[k]]
            ps = ParameterServer.create(
                c, model.n_params, store=os.path.join(store, "ps"), workers=shard_places, layout=layout,
                vectors={"x": x_start[plan.perm]}, timeout=call_timeout,
            )  # fmt: skip
            reason = "max_steps" if max_steps is not None and sum(limits) == max_steps else "epochs"
            try:
                args = (
                    rule,
                    step_lr,
                    l2,
                    batch_size,
                    seed,
                    shuffle,
                    call_timeout,
                    trace,
                    TrainResult,
                    reason,
                )
                return _drive(c, ps, plan, dataset, row_ranges, owned, places, limits, *args)
            finally:
                ps.close()
    finally:
        if tmp is not None:
            tmp.cleanup()


def _drive(
    c: Client,
    ps: ParameterServer,
    plan: PartitionPlan,
    dataset: Dataset,
    row_ranges: Sequence[tuple[int, int]],
    owned: Sequence[Sequence[int]],
    places: Sequence[str],
    limits: Sequence[int],
    rule: str,
    lr: float,
    l2: float,
    batch_size: int,
    seed: int,
    shuffle: bool,
    call_timeout: float,
    trace: bool,
    result_cls: Any,
    stop_reason: str,
) -> Any:
    run_id = uuid.uuid4().hex[:12]
    K = plan.partitions
    shard_map = ps.shard_map()
    futures: list[list[Any]] = []
    for r, (lo, hi) in enumerate(row_ranges):
        config = PartitionConfig(run_id, rule, lr, l2, batch_size, seed, shuffle, limits[r], call_timeout)
        futures.append(
            [
                c.submit(
                    PartitionActor,
                    r,
                    k,
                    plan,
                    dataset,
                    lo,
                    hi,
                    shard_map,
                    owned[k],
                    config,
                    actor=True,
                    workers=[places[k % len(places)]],
                    allow_other_workers=False,
                    pure=False,
                    key=f"partition-{r}-{k}-{run_id}",
                )
                for k in range(K)
            ]
        )
    actors = [[f.result() for f in row] for row in futures]
    for row in actors:
        for ok, value in gather_calls(c, [start_call(a, "connect", row) for a in row], timeout=call_timeout):
            if not ok:
                raise ClusterError(f"a partition could not be connected to its peers: {value!r}")
    t0 = time.perf_counter()
    flat = [a for row in actors for a in row]
    budget = call_timeout * (1 + max(limits))
    outcomes = gather_calls(c, [start_call(a, "run") for a in flat], timeout=budget)
    wall = time.perf_counter() - t0
    for ok, value in outcomes:
        if not ok:
            raise ClusterError(f"a partition failed: {value!r}") from (
                value if isinstance(value, BaseException) else None
            )
    statuses = [value for _, value in outcomes]
    x_perm = ps.gather("x")
    x = np.empty_like(x_perm)
    x[plan.perm] = x_perm
    steps = sum(st["steps"] for st in statuses if st["partition"] == 0)
    messages = sum(st["messages"] for st in statuses)
    n_bytes = sum(st["bytes"] for st in statuses)
    by_kind: dict[str, float] = {}
    for st in statuses:
        for kind, count in st["by_kind"].items():
            by_kind[kind] = by_kind.get(kind, 0) + count / max(1, steps)
    staleness = [s for st in statuses for s in st["staleness"]]
    losses = (
        {st["replica"]: np.array(st["losses"]) for st in statuses if st["partition"] == 0} if trace else {}
    )
    history = xr.Dataset(
        {"step": ("time", np.array([0, steps]))},
        coords={"time": np.array([0.0, wall])},
        attrs={"replicas": len(row_ranges), "partitions": K, "rule": rule, "lr": lr},
    )
    stats = {
        "replicas": len(row_ranges),
        "partitions": K,
        "shards": ps.shards,
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
    by_steps = stop_reason == "max_steps"
    return result_cls(
        x=x, history=history, stop_reason=stop_reason, success=True,
        message="reached max_steps" if by_steps else "every replica finished its epochs",
        steps=steps, wall_time=wall, store=ps.url, stats=stats, losses=losses,
    )  # fmt: skip


#: ``downpour.train`` options a partitioned run takes, and the defaults of the ones it does not support.
_SUPPORTED = ("replicas", "rule", "lr", "l2", "batch_size", "epochs", "max_steps", "seed", "x0", "shuffle",
              "client", "store", "trace", "call_timeout")  # fmt: skip
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "shards": None,
    "local_lr": None,
    "n_fetch": 1,
    "n_push": 1,
    "warmstart_steps": 0,
    "time_limit": None,
    "eval_data": None,
    "callback": None,
    "staleness_scale": None,  # the default (on for multi-replica SGD elsewhere): partitions run unscaled
    "shard_workers": None,
    "replica_workers": None,
    "max_coalesce": None,
}


def train_from_options(model: Any, data: Any, *, partitions: int, given: dict[str, Any]) -> Any:
    """``downpour.train(..., partitions=K)``: check the options a partitioned run supports, then run it.

    Examples
    --------
    >>> train_from_options(model, data, partitions=2, given={"n_fetch": 3})  # doctest: +SKIP
    Traceback (most recent call last):
    distbelief.errors.InvalidOptionError: n_fetch=3 is not supported with partitions=2; ...
    """
    for name, default in _UNSUPPORTED_DEFAULTS.items():
        if name in given and given[name] is not default and given[name] != default:
            if name == "staleness_scale" and given[name] is False:
                continue  # unscaled is what a partitioned run does
            raise InvalidOptionError(
                f"{name}={given[name]!r} is not supported with partitions={partitions}; leave it at its "
                f"default ({default!r}) or train with partitions=1"
            )
    if given.get("max_staleness") not in (None, 0):
        raise InvalidOptionError(
            f"max_staleness={given['max_staleness']!r} is not supported with partitions={partitions}: every "
            "partition fetches before each step (pass 0 or None)"
        )
    kwargs = {name: given[name] for name in _SUPPORTED if name in given}
    if kwargs.get("replicas") is None:
        kwargs.pop("replicas", None)
    return train_partitioned(model, data, partitions=partitions, **kwargs)
