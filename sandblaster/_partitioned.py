"""Sandblaster on partitioned replicas: every portion computed by a replica split into K partition actors
(paper, section 3 and section 4.2, Figures 1 and 2).

``sandblaster.minimize(..., partitions=K)`` builds each model replica as K :class:`SandblasterPartition`
actors (``models.partition_plan``: the MLP split by units, the locally connected network spatially), on
different workers. Partition ``k`` holds only its parameter slice: it fetches it from, and pushes its
gradient slice to, only the shards that hold it (the shards are aligned to the partitions by
:func:`storage.partition_layout`; the parameter vector on the shards is the partition-major ``w[plan.perm]``,
which the coordinator's elementwise ops and dot products do not see). Partitions exchange only the
activations and input-gradients that cross their boundaries, actor to actor (:mod:`storage._exchange`,
the same pass runner as Downpour's partitions).

The portion scheduler is unchanged: it talks to partition 0 of each replica (the *head*) with the same
:class:`~sandblaster._messages.WorkCall` and gets the same :class:`~sandblaster._messages.WorkReport`. The
head hands the call to its peers (one message each), every partition runs its share of every portion
(the pass of portion ``p`` is keyed ``(call, p)``), pushes its slice's binned sum to its own shards, and
returns its shards' setup and final results; the head merges them. So every shard still counts every
portion exactly once (``Shard.accumulate``), and its sums are exact, whichever replica computed what.

Faults (issue 14, item 4): a replica whose partition lost its worker is **rebuilt**: the lost partitions
are started again on live workers (they hold no state the shards do not: their slice is fetched again), the
survivors are reconnected (their passes under way are aborted), and the scheduler re-sends what the replica's
calls carried, solo (:meth:`~sandblaster._portions.PortionMachine.replace`). The answer is the same, bit for
bit: every portion's loss and gradient slices are the same numbers whoever computes them, and the shards
sum exactly. Rebuilds are bounded (:data:`MAX_REBUILDS` per run); past that, or with no live worker to
rebuild on, the replica is lost and the others redo its work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import scipy.sparse
from distributed import Client, Future

from distbelief.errors import ClusterError, InvalidOptionError
from distbelief.models import Model, partition_plan
from distbelief.models.internal import AnyPlan, PartitionPlan
from distbelief.storage import Dataset, ShardMap, default_row_cache, keep_loop_responsive, reuse_freed_memory
from distbelief.storage import reduce_results as _reduce_results
from distbelief.storage.internal import (
    DEAD_STATES,
    PartitionPeer,
    PassAborted,
    await_call,
    call_peer,
    exactsum,
    install_direct_calls,
    worker_alive,
)

from ._messages import WorkCall, WorkReport, decode, encode
from ._portions import Instruction
from ._scheduler import PortionScheduler

__all__ = [
    "MAX_REBUILDS",
    "PartitionedScheduler",
    "ReplicaGroup",
    "SandblasterPartition",
    "check_partitioned",
    "place_partitions",
    "start_replicas",
]

#: Replica rebuilds allowed per run (each after a partition's worker died); one more loss is a lost replica.
MAX_REBUILDS = 8
#: Seconds to start a rebuilt partition and reconnect its replica before the replica is given up as lost.
REBUILD_TIMEOUT = 60.0

logger = logging.getLogger(__name__)


class SandblasterPartition(PartitionPeer):
    """Dask actor: partition ``k`` of Sandblaster replica ``replica`` (partition 0 is the replica's head).

    Parameters
    ----------
    replica, k : int
        Replica and partition numbers.
    plan : models.MLPPlan or models.LocallyConnectedPlan
        The partitioned model.
    dataset : storage.Dataset
        Training rows in portions (the partition keeps only its input columns of the portions it computed).
    shard_map : storage.ShardMap
        The parameter server (partition-major vector); the partition talks only to ``shards``.
    shards : list of int
        The shards holding this partition's parameters, in order.
    call_timeout : float
        Seconds a shard call or a peer's message may take, stretched for wide shards already
        (:attr:`storage.ParameterServer.timeout`): the shard calls do not stretch it again.

    Examples
    --------
    >>> fut = client.submit(SandblasterPartition, 0, 1, plan, ds, ps.shard_map(), [1], 60.0,
    ...                     actor=True)                                   # doctest: +SKIP
    """

    #: Methods the coordinator calls straight through the worker's handler (:mod:`storage._direct`).
    DIRECT_METHODS = frozenset({"work"})
    ALGORITHM = "sandblaster"

    def __init__(
        self,
        replica: int,
        k: int,
        plan: PartitionPlan,
        dataset: Dataset,
        shard_map: ShardMap,
        shards: Sequence[int],
        call_timeout: float = 60.0,
    ) -> None:
        keep_loop_responsive()  # its compute thread must not slow the shards' and the peers' messages
        reuse_freed_memory()  # a Dask worker's allocator would mmap every gradient temporary afresh
        install_direct_calls()  # the coordinator's work calls come straight to a worker handler
        super().__init__(replica, k, call_timeout=call_timeout)
        self.plan, self.dataset, self.map = plan, dataset, shard_map
        self.shards = list(shards)
        self.columns = plan.input_columns(k)
        self.cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._rows = default_row_cache()
        # One thread: the passes of overlapping calls take turns, while the loop moves messages.
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"sandblaster-partition-{replica}-{k}")
        self._fetch: tuple[int, asyncio.Future[Any]] | None = None
        self._uid = uuid.uuid4().hex[:8]  # call tokens stay unique when a head is rebuilt
        self._calls = 0
        self._active: set[str] = set()
        self.fetches = 0
        self.bytes_pulled = 0
        self.bytes_pushed = 0

    # -- wiring ----------------------------------------------------------------------------------------
    async def connect(self, peers: Sequence[Any]) -> None:
        """The replica's K partitions; a reconnection (after a rebuild) aborts every call under way."""
        for token in list(self._active):
            self.abort(token)
        await super().connect(peers)

    async def attach(self, shard_map: ShardMap) -> dict[str, Any]:
        """Talk to these shards from now on (rebuilt after a loss); the head tells its peers too."""
        self.map = shard_map
        self._fetch = None
        if self.k == 0:
            await asyncio.gather(*(call_peer(p, "attach", shard_map) for p in self.peers[1:]))
        return await self.stats()

    async def stats(self) -> dict[str, Any]:
        """Counters for tests and benchmarks (the head's include its peers' bytes and messages)."""
        own = {
            "partition": self.k,
            "fetches": self.fetches,
            "cached_portions": sorted(self.cache),
            "bytes_pulled": self.bytes_pulled,
            "bytes_pushed": self.bytes_pushed,
            "messages": self.messages,
            "message_bytes": self.bytes,
            "sparse": False,
        }
        if self.k != 0:
            return own
        others = await asyncio.gather(*(call_peer(p, "stats") for p in self.peers[1:]))
        for key in ("bytes_pulled", "bytes_pushed", "messages", "message_bytes"):
            own[key] += sum(o[key] for o in others)
        own["partitions"] = [own["partition"], *(o["partition"] for o in others)]
        return own

    async def close(self) -> None:
        """Stop the compute thread (the head closes its peers too, without waiting)."""
        self._compute.shutdown(wait=False, cancel_futures=True)
        if self.k == 0:
            for p in self.peers[1:]:
                with contextlib.suppress(Exception):
                    asyncio.ensure_future(call_peer(p, "close")).add_done_callback(
                        lambda f: f.cancelled() or f.exception()
                    )

    # -- one partition's share of a work call ----------------------------------------------------------
    def _portion(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        got = self.cache.get(p)
        if got is None:
            X, y = self._rows.rows(self.dataset, *self.dataset.portion_bounds(p))
            got = self.cache[p] = (np.ascontiguousarray(X[:, self.columns]), y)
        return got

    async def _fetch_own(
        self, eval_id: int, x_name: str, prep: Sequence[Sequence[Any]]
    ) -> tuple[np.ndarray, dict[int, list[Any]]]:
        parts = await asyncio.gather(
            *(
                self.map.ask(
                    i,
                    "prepare_and_fetch",
                    eval_id,
                    list(prep),
                    [x_name],
                    timeout=self.call_timeout,
                    scale=False,
                )
                for i in self.shards
            )
        )
        w_k = np.concatenate([p[1][0] for p in parts])
        self.bytes_pulled += 8 * w_k.size
        return w_k, {i: p[2] for i, p in zip(self.shards, parts, strict=True)}

    async def _params(
        self, eval_id: int, x_name: str, prep: Sequence[Sequence[Any]]
    ) -> tuple[np.ndarray, dict[int, list[Any]], bool]:
        fetched = self._fetch is None or self._fetch[0] != eval_id
        if fetched:
            self._fetch = (eval_id, asyncio.ensure_future(self._fetch_own(eval_id, x_name, prep)))
            self.fetches += 1
        assert self._fetch is not None
        w_k, prep_by_shard = await asyncio.shield(self._fetch[1])
        return w_k, prep_by_shard, fetched

    def _run(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    @property
    def _base(self) -> int:
        return self.map.layout.ranges()[self.shards[0]][0]

    def _push(
        self, call: WorkCall, portions: list[int], grad: np.ndarray
    ) -> list[tuple[int, asyncio.Future[Any]]]:
        """This partition's slice of a gradient (or of a binned sum) to each of its own shards."""
        base = self._base
        out: list[tuple[int, asyncio.Future[Any]]] = []
        for i in self.shards:
            lo, hi = self.map.layout.ranges()[i]
            part = grad[..., lo - base : hi - base]
            self.bytes_pushed += part.nbytes  # a binned group sum is 4 values a parameter, not 1
            ask = self.map.ask(
                i,
                "accumulate",
                call.acc_name,
                part,
                portions,
                call.eval_id,
                call.solo,
                timeout=self.call_timeout,
                scale=False,
            )
            out.append((i, asyncio.ensure_future(ask)))
        return out

    async def share(self, token: str, call: WorkCall) -> dict[str, Any]:
        """Run this partition's share of work call ``token`` (every portion's pass, its pushes).

        Returns ``{"stale": True}`` when the call's evaluation is over (its peers' passes are aborted), else
        the portions' losses (partition 0 only), its shards' setup and final results, and timings.
        """
        if self._fetch is not None and call.eval_id < self._fetch[0]:
            self.abort(token)
            for p in self.peers:
                with contextlib.suppress(Exception):
                    await call_peer(p, "abort_pass", token)
            return {"stale": True}
        self._active.add(token)
        try:
            return await self._share(token, call)
        except OSError as exc:
            # A shard's connection dropped: a failed call of this partition, as an unpartitioned replica
            # reports it (the coordinator then probes the shards and restores a lost one).
            raise ClusterError(
                f"partition {self.k} of replica {self.replica} could not reach its shards: {exc!r}"
            ) from exc
        finally:
            self._active.discard(token)

    async def _share(self, token: str, call: WorkCall) -> dict[str, Any]:
        t0 = time.perf_counter()
        w_k, prep_by_shard, fetched = await self._params(call.eval_id, call.x_name, call.prep)
        t1 = time.perf_counter()
        step = max(1, call.push_every or len(call.portions) or 1)
        portions = list(call.portions)
        groups = [portions[i : i + step] for i in range(0, len(portions), step)]
        results: list[tuple[int, float, int]] = []
        pushes: list[tuple[int, asyncio.Future[Any]]] = []
        read_s = 0.0
        reads: list[int] = []
        try:
            for group in groups:
                total: np.ndarray | None = None
                first: np.ndarray | None = None
                for p in group:
                    if p not in self.cache:
                        start = time.perf_counter()
                        await self._run(self._portion, p)
                        read_s += time.perf_counter() - start
                        reads.append(int(p))
                    X_k, y = self.cache[p]
                    gen = self.plan.partition_pass(self.k, w_k, X_k, y)
                    loss, grad = await self.run_pass((token, p), gen, run=self._run)
                    if self.k == 0:
                        results.append((int(p), float(loss), int(X_k.shape[0])))
                    if call.solo:
                        pushes += self._push(call, [int(p)], grad)
                    elif first is None:
                        first = grad
                    else:
                        # Summed exactly (binned), as an unpartitioned replica does: the shards' sum has the
                        # same bits whichever portions share a push.
                        if total is None:
                            total = exactsum.deposit(exactsum.zeros(first.size), first)
                        exactsum.deposit(total, grad)
                if not call.solo and first is not None:
                    pushes += self._push(call, [int(p) for p in group], first if total is None else total)
        except BaseException:
            for _, push in pushes:
                push.cancel()
            raise
        t2 = time.perf_counter()
        answers = await asyncio.gather(*(push for _, push in pushes))
        final = {i: fin for (i, _), (_, fin) in zip(pushes, answers, strict=True) if fin is not None}
        return {
            "results": results,
            "prep": prep_by_shard,
            "final": final,
            "fetched": fetched,
            "fetch_s": t1 - t0,
            "compute_s": t2 - t1,
            "read_s": read_s,
            "reads": reads,
            "push_s": time.perf_counter() - t2,
        }

    # -- the head: one work call of the scheduler ------------------------------------------------------
    async def _peer_share(self, m: int, token: str, call: WorkCall) -> dict[str, Any]:
        peer = self.peers[m]
        address = getattr(peer, "_address", None)

        async def gone() -> bool:
            # The scheduler query may block: keep it off the event loop the shards and peers run on.
            return not await asyncio.to_thread(worker_alive, address)

        try:
            result: dict[str, Any] = await await_call(
                call_peer(peer, "share", token, call),
                timeout=None,
                gone=gone,
                what=f"partition {m} of replica {self.replica}",
            )
        except PassAborted:
            raise
        except Exception as exc:
            # The peer itself lost (or a dropped connection to it, which the scheduler may not know of yet):
            # the replica is broken, an OSError tells the portion scheduler to check for a dead worker. Any
            # other failure (its shards') is the call's own.
            if isinstance(exc, OSError) or not await asyncio.to_thread(worker_alive, address):
                raise ConnectionError(f"partition {m} of replica {self.replica} was lost: {exc!r}") from exc
            raise
        return result

    async def work(self, request: bytes) -> bytes:
        """The scheduler's :class:`WorkCall` in, the replica's :class:`WorkReport` out (the head only).

        Raises
        ------
        ConnectionError
            A peer partition was lost: the scheduler then checks whether the replica lost a worker and
            rebuilds it (an ``OSError``, as a dropped connection to an unpartitioned replica would be).
        distbelief.errors.ClusterError
            A shard could not be reached (the coordinator probes the shards and restores a lost one).
        """
        call = decode(request, WorkCall)
        if self._fetch is not None and call.eval_id < self._fetch[0]:
            return encode(WorkReport())  # a late call of an evaluation that is over
        token = f"{self._uid}-{self._calls}"
        self._calls += 1
        K = len(self.peers)
        tasks = [asyncio.ensure_future(self.share(token, call))]
        tasks += [asyncio.ensure_future(self._peer_share(m, token, call)) for m in range(1, K)]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            self.abort(token)
            for p in self.peers[1:]:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(call_peer(p, "abort_pass", token), 5.0)
            for t in pending:
                t.cancel()
            for t in tasks:
                if t.done() and not t.cancelled():
                    t.exception()  # seen
            # A lost peer first (the replica is rebuilt), else the first real failure (not a pass aborted
            # because of it): a shard's goes to the coordinator as a ClusterError, as an unpartitioned
            # replica's does.
            errors = [e for e in (t.exception() for t in failed) if e is not None]
            lost = [e for e in errors if isinstance(e, ConnectionError)]
            real = [e for e in errors if not isinstance(e, PassAborted)]
            raise (lost or real or errors)[0]
        parts = [t.result() for t in tasks]
        if any(part.get("stale") for part in parts):
            return encode(WorkReport())
        prep_by_shard: dict[int, list[Any]] = {}
        final: dict[int, list[Any]] = {}
        for part in parts:
            prep_by_shard.update(part["prep"])
            final.update(part["final"])
        prep: list[Any] = []
        if call.prep:
            n_shards = self.map.layout.shards
            prep = _reduce_results(call.prep, [prep_by_shard.get(i, []) for i in range(n_shards)])
        head = parts[0]
        return encode(
            WorkReport(
                results=tuple(head["results"]),
                prep=tuple(prep),
                final=final,
                fetched=bool(head["fetched"]),
                fetch_s=max(p["fetch_s"] for p in parts),
                compute_s=max(p["compute_s"] for p in parts),
                read_s=max(p["read_s"] for p in parts),
                reads=tuple(sorted({r for p in parts for r in p["reads"]})),
                push_s=max(p["push_s"] for p in parts),
            )
        )


class ReplicaGroup:
    """The K partition actors of one replica, their futures and workers; dead when any partition is.

    Stands where an unpartitioned replica's future stands in :class:`PortionScheduler` (its ``status``).

    Examples
    --------
    >>> group = ReplicaGroup([fut0, fut1], [a0, a1], ["tcp://w0", "tcp://w1"])   # doctest: +SKIP
    >>> group.status                                                            # doctest: +SKIP
    'finished'
    """

    def __init__(self, futures: Sequence[Future[Any]], actors: Sequence[Any], places: Sequence[str]) -> None:
        self.futures, self.actors, self.places = list(futures), list(actors), list(places)

    @property
    def status(self) -> str:
        """``"lost"`` once any partition's worker is gone, else the head's future's status."""
        if any(f.status in DEAD_STATES for f in self.futures):
            return "lost"
        return str(self.futures[0].status)

    def dead(self) -> list[int]:
        """The partitions whose worker is gone."""
        return [k for k, f in enumerate(self.futures) if f.status in DEAD_STATES]

    def release(self) -> None:
        """Release every partition's future."""
        for f in self.futures:
            with contextlib.suppress(Exception):
                f.release()


def place_partitions(replica: int, partitions: int, workers: Sequence[str]) -> list[str]:
    """Workers of replica ``replica``'s partitions: ``workers[(replica + k) % len(workers)]``.

    Consecutive partitions go to different workers (the point of model parallelism), and the replicas'
    heads are spread over the workers too.

    Examples
    --------
    >>> place_partitions(1, 2, ["a", "b", "c"])
    ['b', 'c']
    """
    return [workers[(replica + k) % len(workers)] for k in range(partitions)]


def start_replicas(
    client: Client,
    plan: PartitionPlan,
    dataset: Dataset,
    shard_map: ShardMap,
    owned: Sequence[Sequence[int]],
    workers: Sequence[str],
    n_replicas: int,
    call_timeout: float,
) -> list[tuple[Any, ReplicaGroup]]:
    """Start ``n_replicas`` replicas of K partition actors each and connect them; ``[(head, group)]``."""
    K = plan.partitions
    futures: list[list[Future[Any]]] = []
    places: list[list[str]] = []
    for r in range(n_replicas):
        where = place_partitions(r, K, workers)
        places.append(where)
        futures.append(
            [
                client.submit(
                    SandblasterPartition,
                    r,
                    k,
                    plan,
                    dataset,
                    shard_map,
                    owned[k],
                    call_timeout,
                    actor=True,
                    workers=[where[k]],
                    allow_other_workers=False,
                    pure=False,
                    key=f"partition-{r}-{k}-{uuid.uuid4().hex[:12]}",  # the service's placement reads it
                )
                for k in range(K)
            ]
        )
    out = []
    for r in range(n_replicas):
        actors = [f.result() for f in futures[r]]
        for a in actors:
            a.connect(actors).result(timeout=call_timeout)
        out.append((actors[0], ReplicaGroup(futures[r], actors, places[r])))
    return out


class PartitionedScheduler(PortionScheduler):
    """:class:`PortionScheduler` over partitioned replicas: a replica that lost a partition is rebuilt.

    Parameters
    ----------
    client, replicas, n_portions, **kwargs
        As :class:`PortionScheduler` (``replicas`` are ``(head actor, ReplicaGroup)`` pairs).
    plan, dataset, shard_map, owned, workers, call_timeout
        What rebuilding a partition takes (as :func:`start_replicas`).
    max_rebuilds : int
        Rebuilds allowed over the run.

    Examples
    --------
    >>> scheduler = PartitionedScheduler(client, replicas, 8, plan=plan, dataset=ds, shard_map=m,
    ...                                  owned=owned, workers=workers)              # doctest: +SKIP
    """

    def __init__(
        self,
        client: Client,
        replicas: list[tuple[Any, Any]],
        n_portions: int,
        *,
        plan: PartitionPlan,
        dataset: Dataset,
        shard_map: ShardMap,
        owned: Sequence[Sequence[int]],
        workers: Sequence[str],
        call_timeout: float = 60.0,
        max_rebuilds: int = MAX_REBUILDS,
        **kwargs: Any,
    ) -> None:
        super().__init__(client, replicas, n_portions, **kwargs)
        self.plan, self.dataset, self.shard_map = plan, dataset, shard_map
        self.owned, self.workers, self.call_timeout = list(owned), list(workers), call_timeout
        self.max_rebuilds = max_rebuilds
        #: ``(replica, partition)`` of every partition rebuilt, in order.
        self.rebuilt: list[tuple[int, int]] = []
        self._rebuilds = 0

    def refresh_shards(self, shard_map: Any, timeout: float = 60.0) -> None:
        """As :meth:`PortionScheduler.refresh_shards`; rebuilt partitions start with the new map too."""
        self.shard_map = shard_map
        super().refresh_shards(shard_map, timeout)

    async def _replica_lost(self, r: int) -> list[Instruction]:
        group: ReplicaGroup = self.replicas[r][1]  # type: ignore[assignment]
        lost = group.dead()
        if not lost or self._rebuilds >= self.max_rebuilds:
            return self.machine.lose(r)
        gone = {group.places[k] for k in lost}
        live = [w for w in self.workers if w not in gone]
        if not live:
            return self.machine.lose(r)
        try:
            new_group = await asyncio.wait_for(self._rebuild(r, group, lost, live), REBUILD_TIMEOUT)
        except Exception as exc:
            # Given up all the same (the other replicas redo its work), but whoever reads the log learns why.
            moves = ", ".join(
                f"partition {k} (lost with {group.places[k]}) on {live[(r + j) % len(live)]}"
                for j, k in enumerate(lost)
            )  # the placement _rebuild tried
            logger.warning(
                "replica %d: rebuilding %s failed: %r; the other replicas take over its work", r, moves, exc
            )
            return self.machine.lose(r)
        self._rebuilds += 1
        self.rebuilt += [(r, k) for k in lost]
        self.replicas[r] = (new_group.actors[0], new_group)  # type: ignore[assignment]
        return self.machine.replace(r)

    async def _rebuild(self, r: int, group: ReplicaGroup, lost: list[int], live: list[str]) -> ReplicaGroup:
        futures, actors, places = list(group.futures), list(group.actors), list(group.places)
        for j, k in enumerate(lost):
            place = live[(r + j) % len(live)]
            fut = self.client.submit(
                SandblasterPartition, r, k, self.plan, self.dataset, self.shard_map, self.owned[k],
                self.call_timeout, actor=True, workers=[place], allow_other_workers=False, pure=False,
                key=f"partition-{r}-{k}-{uuid.uuid4().hex[:12]}",
            )  # fmt: skip
            futures[k], places[k] = fut, place
            actors[k] = await fut._result()
        survivors = [k for k in range(len(actors)) if k not in lost]
        # Survivors are reconnected first (their passes under way are aborted), then the new partitions.
        await asyncio.gather(*(actors[k].connect(actors)._result() for k in survivors))
        await asyncio.gather(*(actors[k].connect(actors)._result() for k in lost))
        for k in lost:
            with contextlib.suppress(Exception):
                group.futures[k].release()
        return ReplicaGroup(futures, actors, places)


def check_partitioned(model: Model, data: Any, partitions: int) -> AnyPlan:
    """The plan of ``model`` in ``partitions`` partitions, or a clear error (before anything is stored).

    Raises
    ------
    distbelief.errors.InvalidOptionError
        A model with no partitioned form, more partitions than its narrowest layer has units, or sparse
        rows (a partition reads dense input columns).

    Examples
    --------
    >>> from distbelief import models
    >>> check_partitioned(models.MLP([4, 3, 2]), None, 2).partitions
    2
    >>> check_partitioned(models.MLP([4, 3, 2]), None, 3)
    Traceback (most recent call last):
    distbelief.errors.InvalidOptionError: partitions=3 is more than the narrowest layer of MLP ...
    """
    plan = partition_plan(model, partitions)
    # Plans that say how their units are split (MLPPlan, LocallyConnectedPlan) are checked here; any other
    # is left to partition_layout, which refuses a partition with no parameters at all.
    if getattr(plan, "min_units", 1) < 1:
        narrowest = min(layer[-1][1] for layer in plan._units)
        raise InvalidOptionError(
            f"partitions={partitions} is more than the narrowest layer of {type(model).__name__} has units "
            f"({narrowest}); every partition must own units of every layer: use partitions <= {narrowest}"
        )
    X = data[0] if isinstance(data, tuple) and data else None
    sparse = (X is not None and scipy.sparse.issparse(X)) or getattr(data, "layout", "dense") == "csr"
    if sparse:
        raise InvalidOptionError(
            f"partitions={partitions} needs dense rows (a partition reads its block of input columns); "
            "convert the sparse rows with .toarray(), or use partitions=1"
        )
    return plan
