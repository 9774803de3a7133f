"""Whole-model replicas (one :class:`downpour._replica.DownpourReplica` actor each), as the driver shell sees
them: placed, started, polled, stopped, repointed. A replica lost with its worker is dropped (the others
carry on); the partitioned kind (``downpour._partitioned``) rebuilds its replicas instead.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from distributed import Client, Future

from distbelief.errors import ClusterError
from distbelief.storage import Dataset, ParameterServer, ShardMap, worker_addresses
from distbelief.storage.internal import actor_gone, gather_calls, start_call, use_sparse

from ._batches import split_rows
from ._driver import DriverMachine
from ._options import DownpourOptions, check_workers
from ._replica import DownpourReplica, RecordPlan, ReplicaConfig
from ._resume import ResumePoint
from ._shards import Shards

__all__ = ["SHARD_MIN_PARAMS", "WholeReplicas"]

#: Below this many parameters the default is a single shard (an extra shard costs a round trip per push).
SHARD_MIN_PARAMS = 1 << 17
_PER_REPLICA = ("steps", "pushes", "fetches", "applied_weight", "applied_steps_sq", "stop_reason", "wait_s",
                "compute_s")  # fmt: skip


class WholeReplicas:
    """The run's whole-model replicas, one actor each, round robin on ``replica_workers``.

    Examples
    --------
    >>> kind = WholeReplicas(client, model, opts)   # doctest: +SKIP
    >>> kind.attach(dataset)                        # doctest: +SKIP
    >>> kind.n_replicas                                      # doctest: +SKIP
    2
    """

    max_rebuilds = 0  # a lost replica is dropped

    def __init__(self, client: Client, model: Any, opts: DownpourOptions) -> None:
        self.client, self.model, self.opts = client, model, opts
        workers = worker_addresses(client, required=True)
        check_workers("shard_workers", opts.shard_workers, workers)
        check_workers("replica_workers", opts.replica_workers, workers)
        self.shard_workers = list(opts.shard_workers or workers)
        self.replica_workers = list(opts.replica_workers or workers)
        self.n_replicas = opts.replicas or len(self.replica_workers)
        self.call_timeout = opts.call_timeout
        self.poll_every = opts.poll_every
        self.meta: dict[str, Any] = {}
        self.machine = DriverMachine(replicas=0)  # the shell's, once it has made it
        self.actors: list[Any] = []
        self.futures: list[Future[Any]] = []

    def attach(self, dataset: Dataset) -> None:
        """The training rows (each replica's part), and what the replicas communicate: key-value fetch and
        push (storage._keys) for sparse rows, unless l2 moves every parameter."""
        self.dataset, self.row_ranges = dataset, split_rows(dataset.n_rows, self.n_replicas)
        wide = use_sparse(self.opts.communication, self.model, dataset.layout == "csr")
        self.communication = "sparse" if wide and not self.opts.l2 else "dense"

    def prepare(self, opts: DownpourOptions) -> DownpourOptions:
        """``opts`` with ``n_fetch``/``n_push`` chosen from what the run communicates."""
        windowed = self.communication == "sparse" and opts.compression is None and not opts.deterministic
        return opts.with_sync(self.model.n_params, windowed=windowed)

    def open_shards(
        self, store: str, opts: DownpourOptions, x_start: np.ndarray
    ) -> tuple[ParameterServer, ResumePoint | None]:
        """New shards holding ``x_start`` (one per shard worker for a large model, else one), or with
        ``resume=True`` the shards the run's last checkpoint left."""
        n = x_start.size
        n_shards = min(opts.shards or (len(self.shard_workers) if n >= SHARD_MIN_PARAMS else 1), n)
        return Shards.open(
            self.client, store, self.n_replicas, x_start, opts, workers=self.shard_workers, shards=n_shards
        )

    def to_model(self, x_ps: np.ndarray) -> np.ndarray:
        """The shards' vector is the model's."""
        return x_ps

    def place(self, shards: Shards, opts: DownpourOptions, record_plan: RecordPlan) -> None:
        """One replica actor per row range, round robin on the replica workers."""
        config = ReplicaConfig(
            run_id=uuid.uuid4().hex[:12], rule=opts.rule, lr=opts.step_size, local_lr=opts.local_lr,
            n_fetch=opts.sync[0], n_push=opts.sync[1], l2=opts.l2, batch_size=opts.batch_size, seed=opts.seed,
            shuffle=opts.shuffle, epochs=opts.epochs, step_limit=opts.max_steps,
            max_staleness=opts.max_staleness, staleness_scale=opts.scales_staleness(self.n_replicas),
            call_timeout=opts.call_timeout, trace=opts.trace, communication=self.communication,
            fuse=opts.fuses, compression=opts.compression, record=record_plan,
            max_coalesce=opts.coalesce_limit, deterministic=opts.deterministic,
        )  # fmt: skip
        if opts.deterministic:
            shards.ps.begin_rounds(self.n_replicas)
        workers = self.replica_workers
        for r, (lo, hi) in enumerate(self.row_ranges):
            future = self.client.submit(
                DownpourReplica, r, self.model, self.dataset, lo, hi, shards.shard_map, config, actor=True,
                workers=[workers[r % len(workers)]], allow_other_workers=False, pure=False,
                key=f"downpour-replica-{r}-{config.run_id}",
            )  # fmt: skip
            self.futures.append(future)
        self.actors = [f.result(timeout=opts.call_timeout) for f in self.futures]

    def resume(self, point: ResumePoint) -> dict[int, dict[str, Any]]:
        """Hand every replica its counters at the checkpoint; their statuses then."""
        for r, p in enumerate(point.replicas):
            self.call([r], "resume_at", (p["steps"], p["rows"], p["epoch"]))
        out = {}
        for r, (ok, value) in self.call(range(self.n_replicas), "status").items():
            if not ok:
                raise ClusterError(f"replica {r} did not answer after resuming: {value!r}")
            out[r] = value
        return out

    def call(
        self, which: Sequence[int], method: str, args: tuple[Any, ...] = (), *, timeout: float | None = None
    ) -> dict[int, tuple[bool, Any]]:
        """Call ``method`` on the replicas ``which`` at once; ``{r: (ok, result or exception)}``."""
        limit = self.call_timeout if timeout is None else timeout
        which = list(which)
        calls = [start_call(self.actors[r], method, *args) for r in which]
        out = gather_calls(self.client, calls, timeout=limit)
        return dict(zip(which, out, strict=True))

    def is_dead(self, r: int) -> bool:
        """Whether replica ``r``'s worker is gone."""
        return actor_gone(self.client, self.futures[r], self.actors[r])

    def start(self, which: Sequence[int]) -> dict[int, tuple[bool, Any]]:
        """Start the replicas ``which`` (their training loops)."""
        return self.call(which, "start")

    def poll(self, which: Sequence[int], plan: RecordPlan, timeout: float) -> dict[int, tuple[bool, Any]]:
        """The replicas' statuses, with the history records they took since the last poll."""
        return self.call(which, "status", (plan,), timeout=timeout)

    def stop(self, which: Sequence[int], timeout: float) -> dict[int, tuple[bool, Any]]:
        """Stop the replicas ``which``; their final statuses."""
        return self.call(which, "stop", (self.call_timeout,), timeout=timeout)

    def set_shard_map(self, which: Sequence[int], shard_map: ShardMap) -> dict[int, tuple[bool, Any]]:
        """Hand the replicas ``which`` a new shard map (a shard was restored)."""
        return self.call(which, "set_shard_map", (shard_map,))

    def wait(self, seconds: float) -> None:
        """Until the next poll (whole replicas report their end in their polled status)."""
        time.sleep(seconds)

    def losses(self, which: Sequence[int]) -> dict[int, np.ndarray]:
        """Every replica's per-step mini-batch losses (``trace=True``)."""
        return {r: np.array(v) for r, (ok, v) in self.call(which, "losses").items() if ok}

    def stats(self, statuses: dict[int, dict[str, Any]], steps: int) -> dict[str, Any]:
        """What only whole replicas report: ``per_replica`` counters."""
        del steps
        return {"per_replica": {r: {k: st[k] for k in _PER_REPLICA} for r, st in sorted(statuses.items())}}

    def close(self, live: Sequence[int] = ()) -> None:
        """Stop the replicas ``live`` still running (a run that failed), and release every actor."""
        if live:
            with contextlib.suppress(Exception):
                self.call(live, "stop", (1.0,), timeout=5.0)
        for f in self.futures:
            with contextlib.suppress(Exception):
                f.release()  # type: ignore[no-untyped-call, unused-ignore]
