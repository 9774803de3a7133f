"""Downpour with model parallelism, the driver's side: ``downpour.train(..., partitions=K)``.

Every replica of the model is K partition actors (:class:`downpour._partition.PartitionActor`, section 3
of the paper) on the shards aligned to them. :class:`PartitionedReplicas` is the partitioned kind's adapter
for the one driver shell (``downpour._train._Run``): it places and connects a replica's K partitions, starts
their ``run`` on the client's event loop, polls their counters into one status per replica (the whole
replicas' format: the shell's history, checkpoints and result read both alike), stops them so that every
partition of a replica ends at the same step, and rebuilds a replica that lost a partition's worker: its
surviving partitions are stopped, and K new ones go on from the step the survivors reached, on live workers
(issue 14, item 4). What the lost partition had not pushed is lost, as a lost replica's gradient is in
Downpour; the shards count what they applied (``Shard.counters``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np
from distributed import Client
from distributed.utils import sync

from distbelief.errors import ClusterError, InvalidOptionError
from distbelief.models import partition_plan
from distbelief.options import defaults
from distbelief.storage import (
    Dataset,
    ParameterServer,
    ShardMap,
    partition_layout,
    partition_shards,
    worker_addresses,
)
from distbelief.storage.internal import DEAD_STATES, POLL, confirm_dead_async

from ._batches import BatchPlan, split_rows
from ._driver import DriverMachine
from ._options import DownpourOptions, check_workers, options_from
from ._partition import PartitionActor, PartitionConfig, check_memory
from ._replica import RecordPlan
from ._resume import ResumePoint
from ._shards import Shards

__all__ = ["PartitionedReplicas", "check_partitioned_options"]

#: Times a run may rebuild a replica that lost a partition's worker before the run fails.
MAX_REBUILDS = 8
#: Seconds a stopped partition has to end its ``run`` before its counters are read with ``status``: one
#: blocked sending to a peer on a dead worker would otherwise hold the rebuild for the whole call timeout.
STOP_GRACE = 2.0
#: Seconds a stopped run gives its partitions to finish the step under way before it aborts the passes
#: still waiting (those of steps a peer will not take).
STOP_SETTLE = 0.3
#: Seconds between two polls of a partitioned run's counters (one small call per partition).
PROGRESS_EVERY = 0.2

T = TypeVar("T")


class PartitionedReplicas:
    """The partitioned replicas of a run, as the driver shell sees them (see the module docstring).

    Parameters
    ----------
    client : distributed.Client
        The cluster.
    model : models.MLP, models.LocallyConnected or models.LocallyConnected2D
        A model with a partitioned form (``models.partition_plan``).
    opts : DownpourOptions
        The run's options (``replicas`` default to 1).
    partitions : int
        Partitions per replica; partition ``k`` runs on ``replica_workers[k % len(replica_workers)]``.

    Examples
    --------
    >>> kind = PartitionedReplicas(client, models.MLP([64, 8, 10]), opts, partitions=2)  # doctest: +SKIP
    >>> kind.attach(dataset)                                                        # doctest: +SKIP
    """

    max_rebuilds = MAX_REBUILDS
    communication = "dense"

    def __init__(self, client: Client, model: Any, opts: DownpourOptions, *, partitions: int) -> None:
        self.client, self.model, self.opts = client, model, opts
        self.plan = plan = partition_plan(model, partitions)
        known = worker_addresses(client, required=True)
        check_workers("replica_workers", opts.replica_workers, known)
        check_workers("shard_workers", opts.shard_workers, known)
        self.places = list(opts.replica_workers or known)
        self.homes = list(opts.shard_workers or self.places)
        check_memory(client, plan, self.places)
        self.n_replicas = opts.replicas or 1
        self.layout = partition_layout(plan.bounds, shards_per_partition=1)
        self.owned = partition_shards(self.layout, plan.bounds)
        self.call_timeout = opts.call_timeout
        self.poll_every = PROGRESS_EVERY  # read at the start of the run: the tests shorten it
        self.meta = {"partitions": plan.partitions}
        self.machine = DriverMachine(replicas=0)  # the shell's, once it has made it
        self.shards: Shards | None = None
        self.actors: list[list[Any]] = []
        self.futures: list[list[Any]] = []
        self.tasks: dict[asyncio.Future[Any], tuple[int, int]] = {}
        #: Per replica: its current generation's partitions' latest counters (their final status once done),
        #: the partitions whose ``run`` ended, and the final statuses of its earlier generations.
        self.current: list[dict[int, dict[str, Any]]] = [{} for _ in range(self.n_replicas)]
        self.finished: list[set[int]] = [set() for _ in range(self.n_replicas)]
        self.ended: list[list[dict[str, Any]]] = [[] for _ in range(self.n_replicas)]
        #: Every partition's final status (stopped generations included), for ``stats["per_partition"]``.
        self.per_partition: list[dict[str, Any]] = []
        self.generation = [0] * self.n_replicas
        self.started_at = [0.0] * self.n_replicas  # run time each replica's current generation started
        self.first_step = [0] * self.n_replicas
        self.last: dict[int, dict[str, Any]] = {}
        self._record_mark = (-math.inf, 0)  # (time, steps) of the last history record
        self._records = 0

    # -- the run's shards and actors -------------------------------------------------------------------
    def attach(self, dataset: Dataset) -> None:
        """The training rows: each replica's part, and its step limit (``epochs``, or its share of
        ``max_steps``)."""
        opts, n = self.opts, self.n_replicas
        self.dataset, self.row_ranges = dataset, split_rows(dataset.n_rows, n)
        self.per_epoch = [
            BatchPlan.for_rows(dataset, lo, hi, batch_size=opts.batch_size, seed=opts.seed, replica=r)
            .batches_per_epoch
            for r, (lo, hi) in enumerate(self.row_ranges)
        ]  # fmt: skip
        self.limits = []
        for r in range(n):
            limit = math.inf if opts.epochs is None else opts.epochs * self.per_epoch[r]
            if opts.max_steps is not None:
                q, extra = divmod(opts.max_steps, n)
                limit = min(limit, q + (1 if r < extra else 0))
            self.limits.append(int(limit))
        exact = opts.max_steps is not None and sum(self.limits) == opts.max_steps
        self.reason = "max_steps" if exact else "epochs"

    def prepare(self, opts: DownpourOptions) -> DownpourOptions:
        """``opts`` with ``n_fetch``/``n_push`` chosen (:func:`downpour.auto_sync`, whole model)."""
        return opts.with_sync(self.model.n_params, windowed=False)

    def open_shards(
        self, store: str, opts: DownpourOptions, x_start: np.ndarray
    ) -> tuple[ParameterServer, ResumePoint | None]:
        """Shards aligned to the partitions (partition ``k``'s on ``shard_workers[k % ...]``), holding the
        partition-major ``x[plan.perm]``; reopened from the last checkpoint with ``resume=True``."""
        K = self.plan.partitions
        places = [self.homes[k % len(self.homes)] for k in range(K) for _ in self.owned[k]]
        return Shards.open(
            self.client, store, self.n_replicas, x_start[self.plan.perm], opts, workers=places,
            layout=self.layout, partitions=K,
        )  # fmt: skip

    def to_model(self, x_ps: np.ndarray) -> np.ndarray:
        """The shards' partition-major vector in the model's own layout."""
        x = np.empty_like(x_ps)
        x[self.plan.perm] = x_ps
        return x

    def place(self, shards: Shards, opts: DownpourOptions, record_plan: RecordPlan) -> None:
        """Every replica's K partitions on their workers, connected to their peers."""
        del record_plan  # the poll makes the records
        self.shards = shards
        config = PartitionConfig(
            uuid.uuid4().hex[:12], opts.rule, opts.step_size, opts.l2, opts.batch_size, opts.seed,
            opts.shuffle, 0, opts.call_timeout, n_fetch=opts.sync[0], n_push=opts.sync[1],
            local_lr=opts.local_lr,
        )  # fmt: skip
        self.configs = [dataclasses.replace(config, step_limit=n) for n in self.limits]
        K = self.plan.partitions
        self.futures = [
            [self._submit(r, k, self.places[k % len(self.places)], 0, shards.shard_map) for k in range(K)]
            for r in range(self.n_replicas)
        ]
        self.actors = [[f.result() for f in row] for row in self.futures]
        self._sync(self._connect_all)

    async def _connect_all(self) -> None:
        for row in self.actors:
            got = await asyncio.gather(*(self._ask(a, "connect", row) for a in row), return_exceptions=True)
            for value in got:
                if isinstance(value, BaseException):
                    raise ClusterError(f"a partition could not be connected to its peers: {value!r}")

    def _submit(self, r: int, k: int, place: str, generation: int, shard_map: ShardMap) -> Any:
        """Partition ``k`` of replica ``r`` (its ``generation``-th build) on the worker ``place``."""
        lo, hi = self.row_ranges[r]
        return self.client.submit(
            PartitionActor, r, k, self.plan, self.dataset, lo, hi, shard_map, self.owned[k], self.configs[r],
            generation, actor=True, workers=[place], allow_other_workers=False, pure=False,
            key=f"partition-{r}-{k}-{generation}-{self.configs[r].run_id}",
        )  # fmt: skip

    def resume(self, point: ResumePoint) -> dict[int, dict[str, Any]]:
        """Every replica's status at the checkpoint: its K partitions go on from its step then."""
        for r, p in enumerate(point.replicas):
            self.first_step[r] = int(p["steps"])
            self.last[r] = self._status(r, time.time(), rows=int(p["rows"]))
        self._record_mark = (-math.inf, point.step)
        return dict(self.last)

    # -- the shell's calls -----------------------------------------------------------------------------
    def _sync(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``await fn()`` on the client's event loop, from the driver's thread (the partitions' calls and
        runs live on that loop: it serves them while the driver sleeps between polls)."""
        loop = self.client.loop
        if loop is None:
            raise ClusterError("the Dask client is closed; connect a client and try again")
        result: T = sync(loop, fn)
        return result

    async def _ask(self, actor: Any, method: str, *args: Any) -> Any:
        return await asyncio.wait_for(getattr(actor, method)(*args)._result(), self.call_timeout)

    def is_dead(self, r: int) -> bool:
        """Whether replica ``r`` lost a partition's worker (it is rebuilt, never dropped)."""
        return any(f.status in DEAD_STATES for f in self.futures[r])

    def start(self, which: Sequence[int]) -> dict[int, tuple[bool, Any]]:
        """Start the partitions' ``run`` of the replicas ``which`` (from the step each starts at)."""
        self._sync(functools.partial(self._start_all, list(which)))
        return {r: (True, None) for r in which}

    async def _start_all(self, which: list[int]) -> None:
        for r in which:
            self._run(r, self.first_step[r])

    def _run(self, r: int, step: int) -> None:
        self.started_at[r] = self.shards.clock() if self.shards is not None else 0.0
        for k, a in enumerate(self.actors[r]):
            task = asyncio.ensure_future(a.run(step)._result())
            task.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.tasks[task] = (r, k)

    def call(
        self, which: Sequence[int], method: str, args: tuple[Any, ...] = (), *, timeout: float | None = None
    ) -> dict[int, tuple[bool, Any]]:
        """The warm start's calls (``hold``, ``release``): never made, ``warmstart_steps`` is refused."""
        raise ClusterError(f"partitioned replicas have no {method!r}")

    def poll(self, which: Sequence[int], plan: RecordPlan, timeout: float) -> dict[int, tuple[bool, Any]]:
        """Every replica's status (its partitions' counters summed): partitions whose ``run`` ended are
        noted, a replica that lost a partition is rebuilt, and a history record (counters only: the shell
        reads the shards' parameters for it) is added when ``plan`` says one is due."""
        del timeout  # each call has the run's call timeout
        out: dict[int, dict[str, Any]] = self._sync(self._poll)
        steps = sum(st["steps"] for st in out.values())
        t_mark, s_mark = self._record_mark
        now = time.time()
        due = plan.every_steps is not None and steps - s_mark >= plan.every_steps
        if steps > s_mark and (due or now - t_mark >= plan.every_s) and out:
            self._record_mark = (now, steps)
            # The shards' parameters on every x_every-th record, as a whole replica's copies (0: never: a
            # model too big to gather for the history).
            wanted = plan.x_every > 0 and self._records % plan.x_every == 0
            self._records += 1
            first = min(out)
            out[first]["records"] = [{**out[first], "x": None, "x_wanted": wanted}]
        return {r: (True, out[r]) for r in which if r in out}

    async def _poll(self) -> dict[int, dict[str, Any]]:
        await self._supervise()
        calls = [
            (r, k, self._ask(a, "counters"))
            for r, row in enumerate(self.actors)
            for k, a in enumerate(row)
            if self.futures[r][k].status not in DEAD_STATES and k not in self.finished[r]
        ]
        got = await asyncio.gather(*(c for _, _, c in calls), return_exceptions=True)
        for (r, k, _), value in zip(calls, got, strict=True):
            if not isinstance(value, BaseException):
                self.current[r][k] = value
        now = time.time()
        for r in range(self.n_replicas):
            if self.current[r]:
                self.last[r] = self._status(r, now)
        return dict(self.last)

    def _status(self, r: int, now: float, rows: int = 0) -> dict[str, Any]:
        """Replica ``r``'s status in the whole replicas' format, from its partitions' counters (the
        current generation's latest, plus the final ones of its earlier generations)."""
        s = len(self.layout.ranges())
        current = list(self.current[r].values())
        pushes, fetches, versions = [0] * s, [0] * s, [0] * s
        totals = dict.fromkeys(("loss_sum", "staleness_sum", "staleness_count", "messages"), 0.0)
        moved = [0, 0]  # parameter bytes fetched, pushed
        for p in self.ended[r] + current:
            for i in p["shard_ids"]:
                pushes[i] += p["pushes_sent"]
                fetches[i] += p["fetches"]
            for key in totals:
                totals[key] += p[key]
            totals["messages"] += len(p["shard_ids"]) * (p["fetches"] + p["pushes_sent"])
            moved[0] += p["fetches"] * p["param_bytes"]
            moved[1] += p["pushes_sent"] * p["param_bytes"]
        for p in current:
            for i, v in zip(p["shard_ids"], p["versions"], strict=True):
                versions[i] = max(versions[i], v)
        steps = min((p["steps"] for p in current), default=self.first_step[r])
        known = self.last[r]["rows"] if r in self.last else rows
        rows = next((p["rows"] for p in current if p["partition"] == 0), known)
        done = len(self.finished[r]) == self.plan.partitions
        return {
            "steps": steps, "rows": rows, "epoch": steps // max(1, self.per_epoch[r]),
            "loss_sum": totals["loss_sum"], "staleness_sum": totals["staleness_sum"],
            "staleness_count": int(totals["staleness_count"]),
            "staleness_max": max((p["staleness_max"] for p in current), default=0),
            "pushes": pushes, "fetches": fetches, "known_versions": versions,
            "fetch_errors": [0] * s, "push_errors": [0] * s, "duplicates": 0, "stale_waits": 0,
            "bytes_fetched": moved[0], "bytes_pushed": moved[1], "messages": int(totals["messages"]),
            "fused": 0, "diverged": False, "time": now, "done": done,
            "stop_reason": self.reason if done else "",
        }  # fmt: skip

    async def _supervise(self) -> None:
        """Note the partitions whose ``run`` ended; rebuild the replicas that lost a partition."""
        broken: set[int] = set()
        errors: dict[int, BaseException] = {}
        for task in [t for t in self.tasks if t.done()]:
            r, k = self.tasks.pop(task)
            if not task.cancelled() and task.exception() is None:
                self.current[r][k] = task.result()
                self.finished[r].add(k)
            else:
                broken.add(r)
                if not task.cancelled():
                    errors.setdefault(r, task.exception())  # type: ignore[arg-type]
        broken |= {r for r, _ in self.tasks.values() if self.is_dead(r)}
        for r in sorted(broken):
            step = await self._stop(r)
            dead = await confirm_dead_async(functools.partial(self.is_dead, r), ConnectionError())
            # The lost worker may have held shards too (or a partition failed on a lost shard): restore
            # them before the replica is rebuilt, so its new partitions get the new shard map.
            assert self.shards is not None
            await asyncio.to_thread(self.shards.probe)
            restored = any(t >= self.started_at[r] for t, _ in self.shards.shard_losses)
            if not dead and not restored:
                why = errors.get(r)
                reason = f": {type(why).__name__}: {why}" if why is not None else ""
                raise ClusterError(
                    f"a partition of replica {r} failed (its worker is alive){reason}"
                ) from why
            await self._rebuild(r)
            self._run(r, step)

    async def _stop(self, r: int) -> int:
        """Stop replica ``r``'s surviving partitions; the step the replica goes on from."""
        mine = [t for t, (rr, _) in self.tasks.items() if rr == r]
        stops = [
            (k, asyncio.ensure_future(a.stop()._result()))
            for k, a in enumerate(self.actors[r])
            if self.futures[r][k].status not in DEAD_STATES
        ]
        for _, stop in stops:
            stop.add_done_callback(lambda f: f.cancelled() or f.exception())
        await self._settle(r, stops + [(self.tasks[t][1], t) for t in mine])
        for _, stop in stops:
            stop.cancel()
        statuses = [st for k, st in self.current[r].items() if k in self.finished[r]]
        for task in mine:
            self.tasks.pop(task, None)
            if task.done() and not task.cancelled() and task.exception() is None:
                statuses.append(task.result())
            else:
                task.cancel()
        if not statuses:
            for k, a in enumerate(self.actors[r]):
                if self.futures[r][k].status not in DEAD_STATES:
                    with contextlib.suppress(Exception):
                        statuses.append({**await self._ask(a, "status"), "stopped": True})
        self.ended[r] += statuses
        self.per_partition += statuses
        self.current[r], self.finished[r] = {}, set()
        self.first_step[r] = max((st["steps"] for st in statuses), default=0)
        return self.first_step[r]

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
        assert self.shards is not None
        self.generation[r] += 1
        g, K, old = self.generation[r], len(self.actors[r]), self.futures[r]
        self.futures[r] = [
            self._submit(r, k, live[k % len(live)], g, self.shards.shard_map) for k in range(K)
        ]
        self.actors[r] = [await f._result() for f in self.futures[r]]
        await asyncio.gather(*(a.connect(self.actors[r])._result() for a in self.actors[r]))
        for f in old:
            with contextlib.suppress(Exception):
                f.release()

    def stop(self, which: Sequence[int], timeout: float) -> dict[int, tuple[bool, Any]]:
        """Stop every partition after the step under way (what each accrued is pushed), abort the passes
        still waiting after :data:`STOP_SETTLE` (a peer stopped first will not run them), and return every
        replica's final status: so every partition of a replica ends at the same step, and the shards hold
        exactly those steps (what a resume relies on)."""
        self._sync(functools.partial(self._stop_all, timeout))
        now = time.time()
        for r in range(self.n_replicas):
            self.per_partition += list(self.current[r].values())
        return {r: (True, self._status(r, now)) for r in which}

    async def _stop_all(self, timeout: float) -> None:
        await self._tell("finish")
        await self._wait_tasks(STOP_SETTLE)
        if any(not t.done() for t in self.tasks):
            await self._tell("stop")
            await self._wait_tasks(timeout)
        for task, (r, k) in list(self.tasks.items()):
            if task.done() and not task.cancelled() and task.exception() is None:
                self.current[r][k] = task.result()
            else:
                task.cancel()
                with contextlib.suppress(Exception):
                    self.current[r][k] = {**await self._ask(self.actors[r][k], "status"), "stopped": True}
        self.tasks.clear()

    async def _wait_tasks(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)

    async def _tell(self, method: str, *args: Any, which: Sequence[int] | None = None) -> None:
        """Call ``method`` on every live partition of the replicas ``which`` (all); failures are ignored (a
        partition that cannot be reached fails its ``run``, and its replica is rebuilt)."""
        calls = [
            self._ask(a, method, *args)
            for r in range(self.n_replicas) if which is None or r in which
            for a, f in zip(self.actors[r], self.futures[r], strict=True)
            if f.status not in DEAD_STATES
        ]  # fmt: skip
        await asyncio.gather(*calls, return_exceptions=True)

    def set_shard_map(self, which: Sequence[int], shard_map: ShardMap) -> dict[int, tuple[bool, Any]]:
        """Hand every live partition of the replicas ``which`` the shard map ``shard_map``."""
        self._sync(functools.partial(self._tell, "set_shard_map", shard_map, which=which))
        return {r: (True, None) for r in which}

    def wait(self, seconds: float) -> None:
        """Until the next poll: ``seconds``, or less once a partition's ``run`` ends (the run's end is then
        seen at once, not up to a poll later: a 10-step run took ~0.2 s more)."""

        async def first_end() -> None:
            running = [t for t in self.tasks if not t.done()]
            if running:
                await asyncio.wait(running, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)

        self._sync(first_end)

    def losses(self, which: Sequence[int]) -> dict[int, np.ndarray]:
        """Partition 0's per-step mini-batch losses of every replica's last generation."""
        out = {}
        for r in which:
            st = self.current[r].get(0)
            if st is not None and "losses" in st:
                out[r] = np.array(st["losses"])
        return out

    def stats(self, statuses: dict[int, dict[str, Any]], steps: int) -> dict[str, Any]:
        """What only a partitioned run has: ``partitions``, ``rebuilt_replicas``, ``per_partition`` (every
        partition's final status), and its peers' traffic per step (activations and their gradients:
        ``messages_per_step``, ``bytes_per_step``, ``messages_by_kind``)."""
        del statuses
        per = [{k: v for k, v in st.items() if k != "losses"} for st in self.per_partition]
        by_kind: dict[str, float] = {}
        for st in per:
            for kind, count in st.get("by_kind", {}).items():
                by_kind[kind] = by_kind.get(kind, 0) + count / max(1, steps)
        return {
            "partitions": self.plan.partitions,
            "rebuilt_replicas": list(self.machine.rebuilt),
            "messages_per_step": sum(st["messages"] for st in per) / max(1, steps),
            "bytes_per_step": sum(st["bytes"] for st in per) / max(1, steps),
            "messages_by_kind": by_kind,
            "per_partition": per,
        }

    def close(self, live: Sequence[int] = ()) -> None:
        """A run that ends (or fails) leaves no partition computing: they would go on training, unseen,
        until their step limit (their actors are released with the run, not their passes)."""

        async def stop_all() -> None:
            for task in self.tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tell("stop"), self.call_timeout)

        del live  # every partition still running is stopped
        if self.tasks:
            with contextlib.suppress(Exception):
                self._sync(stop_all)
        for row in self.futures:
            for f in row:
                with contextlib.suppress(Exception):
                    f.release()


#: ``downpour.train`` options a partitioned run does not take: refused unless left at their defaults.
# staleness_scale's default turns it on for multi-replica SGD elsewhere: partitions run unscaled. A
# partitioned run has no warm start, time limit, compressed, coalesced, fused or key-value pushes, rounds,
# or driver poll cadence of its own (it polls every PROGRESS_EVERY).
_UNSUPPORTED = ("shards", "warmstart_steps", "time_limit", "compression", "max_coalesce", "deterministic",
                "staleness_scale", "poll_every", "fuse", "communication")  # fmt: skip
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    name: default for name, default in defaults(DownpourOptions).items() if name in _UNSUPPORTED
}


def check_partitioned_options(partitions: int, given: dict[str, Any]) -> DownpourOptions:
    """Refuse the ``downpour.train`` options a partitioned run does not support; the run's options.

    ``given`` maps option names to values (``downpour.train``'s locals, or a job's options).

    Raises
    ------
    distbelief.errors.InvalidOptionError
        An option other than its default that partitions do not support, a bad value, or no ``epochs`` and
        no ``max_steps``.

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
    taken = {k: v for k, v in given.items() if k not in (*_UNSUPPORTED, "max_staleness")}
    return options_from(taken, staleness_scale=False)
