"""A Downpour run's parameter server, as the driver shell uses it (whole and partitioned replicas alike).

One path for the shards' life in a run: created with the starting point and their first checkpoint (or
reopened from the last one with ``resume=True``), every op through :class:`storage.internal.ShardRecovery`
(a shard lost with its worker is rebuilt from its last checkpoint on a live worker, the replicas are handed
the new shard map, and the op is retried: the paper's section 4.1), and checkpoints carrying the replicas'
counters for ``resume`` (:func:`downpour._resume.checkpoint_meta`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from distributed import Client

from distbelief.errors import InvalidOptionError, ShardLostError
from distbelief.storage import Layout, ParameterServer, ShardMap
from distbelief.storage.internal import ShardRecovery, normalize_url, read_attrs

from ._options import DownpourOptions
from ._resume import ResumePoint, checkpoint_meta, params_store, require_resume_point

__all__ = ["MAX_RECOVERIES", "Shards"]

#: How many lost shards a run recovers from before it gives up.
MAX_RECOVERIES = 5

T = TypeVar("T")


class Shards:
    """The run's parameter server: its ops, its checkpoints, its lost shards restored.

    Parameters
    ----------
    ps : storage.ParameterServer
        The shards (from :meth:`open`).
    clock : callable
        The run's time now (what a restored shard's entry in ``shard_losses`` says).
    repoint : callable
        Hands the replicas a new shard map after a restore.
    checkpoints : int
        Checkpoints taken before (the initial one of a new run).

    Examples
    --------
    >>> ps, _ = Shards.open(client, store, 2, x, DownpourOptions(max_steps=9), workers=None)  # doctest: +SKIP
    >>> shards = Shards(ps, clock=lambda: 0.0, repoint=print)                 # doctest: +SKIP
    >>> shards.checkpoint(1.5, {}, 2); shards.checkpoints                        # doctest: +SKIP
    2
    """

    def __init__(
        self,
        ps: ParameterServer,
        clock: Callable[[], float],
        repoint: Callable[[ShardMap], None],
        checkpoints: int = 1,
    ) -> None:
        self.ps, self.clock, self.repoint = ps, clock, repoint
        self.recovery = ShardRecovery(ps, max_recoveries=MAX_RECOVERIES, on_restored=self._restored)
        self.shard_map = ps.shard_map()
        self.checkpoints = checkpoints
        #: ``(seconds into the run, shard)`` of every shard restored.
        self.shard_losses: list[tuple[float, int]] = []

    @staticmethod
    def open(
        client: Client,
        store: str,
        n_replicas: int,
        x: np.ndarray,
        opts: DownpourOptions,
        *,
        workers: Sequence[str] | None,
        shards: int = 1,
        layout: Layout | None = None,
        partitions: int | None = None,
    ) -> tuple[ParameterServer, ResumePoint | None]:
        """New shards holding ``x`` (and zero Adagrad accumulators), checkpointed once: a shard lost before
        the first periodic checkpoint comes back from this one (its meta says ``partitions`` when given). With
        ``opts.resume``: the shards as the run's last checkpoint left them, and where the run was.

        Raises
        ------
        distbelief.errors.InvalidOptionError
            ``resume``: no checkpoint in ``store``, or one of a run with another model (as many parameters as
            ``x``), partitions or layout: checked before any shard is rebuilt.
        """
        if not opts.resume:
            ps = ParameterServer.create(
                client, x.size, shards=shards, layout=layout, store=params_store(store), workers=workers,
                vectors={"x": x}, timeout=opts.call_timeout, overwrite=True,
            )  # fmt: skip
            if opts.rule == "adagrad":
                # The accumulators exist from the start: every checkpoint (and a restored shard) holds them.
                ps.fill("x.adagrad", 0.0)
            extra = {} if partitions is None else {"partitions": partitions}
            ps.checkpoint(meta=checkpoint_meta(0.0, {}, n_replicas, **extra))
            return ps, None
        point = require_resume_point(store, n_replicas)
        attrs = read_attrs(normalize_url(params_store(store)))
        saved = Layout.from_dict(attrs["layout"])
        was = (attrs.get("meta") or {}).get("partitions")
        if layout is not None and (was != partitions or saved.ranges() != layout.ranges()):
            raise InvalidOptionError(
                f"the checkpoint in {params_store(store)!r} is of a run with partitions={was} and "
                f"{saved.n} parameters in {saved.shards} shards; resume it with the model, partitions and "
                "shards_per_partition of that run"
            )
        if saved.n != x.size:
            raise InvalidOptionError(
                f"the checkpoint holds {saved.n} parameters but the model has {x.size}; resume with the "
                "model of the interrupted run"
            )
        ps = ParameterServer.open(
            client, store=params_store(store), workers=workers, timeout=opts.call_timeout
        )
        return ps, point

    def _restored(self, err: ShardLostError) -> None:
        """A shard came back from its checkpoint: noted, and the replicas handed the new shard map."""
        self.shard_losses.append((self.clock(), err.shard))
        self.shard_map = self.ps.shard_map()
        self.repoint(self.shard_map)

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()``, a parameter-server op: a lost shard is restored and the op retried."""
        result: T = self.recovery.run(fn)
        return result

    def probe(self) -> None:
        """Ping every shard; a lost one is restored."""
        self.recovery.probe()

    def checkpoint(
        self, now: float, counters: dict[int, dict[str, Any]], n_replicas: int, **meta: Any
    ) -> None:
        """Checkpoint the shards with the replicas' ``counters`` at the run's time ``now`` (``resume``)."""
        info = checkpoint_meta(now, counters, n_replicas, **meta)
        self.run(lambda: self.ps.checkpoint(meta=info))
        self.checkpoints += 1
