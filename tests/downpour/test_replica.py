"""downpour._replica.DownpourReplica in one process (no cluster): the actor's compute loop against an
in-process shard, to provoke a race at a chosen moment instead of waiting for load to produce it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from distbelief import models
from distbelief.downpour._replica import DownpourReplica, ReplicaConfig
from distbelief.storage import Dataset, Layout, Shard, ShardMap


class _LocalShard:
    """The Downpour methods of a shard actor, on a :class:`storage.Shard` in this process."""

    def __init__(self, core: Shard) -> None:
        self.core = core

    async def fetch(self, names: list[str]) -> tuple[int, list[np.ndarray]]:
        return self.core.version, [self.core.get(name) for name in names]

    async def push(self, grad: np.ndarray, **kwargs: Any) -> tuple[bool, int, int]:
        return self.core.push(grad, **kwargs)

    async def push_fetch(self, grad: np.ndarray, names: list[str], **kwargs: Any) -> Any:
        return self.core.push_and_fetch(grad, names, **kwargs)


class _LocalMap(ShardMap):
    """A shard map whose shards are objects of this process (ShardMap.call would go over RPC)."""

    async def call(self, shard: int, method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.actors[shard], method)(*args, **kwargs)


def test_the_first_gradient_is_at_the_parameters_fetched_after_the_rows_were_read(tmp_path: Path) -> None:
    """A replica's first read of its rows (50-100 ms under load: it opens the store on its worker) while
    another replica's push lands: the gradient must be at the parameters with that push, not at x0. The
    fetch used to go out before the read, so the first step ran at x0 (logistic: a loss of exactly ln 2,
    which the driver's divergence check then took for a loss grown back to where the run started)."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(8, 2)), rng.normal(size=8)
    model = models.LeastSquares(2)
    n = model.n_params
    shard = Shard(0, 0, n)
    shard.set("x", 0, n, np.zeros(n))
    dataset = Dataset.from_arrays(X, y, path=tmp_path / "rows")
    read = dataset.read_rows

    def read_while_another_replica_pushes(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        if shard.version == 0:  # the other replica's first push lands during this replica's first read
            shard.push(np.array([-1.0, 2.0, -0.5]), source="other", seq=0, rule="sgd", lr=1.0)
        return read(lo, hi)

    dataset.read_rows = read_while_another_replica_pushes  # type: ignore[method-assign,assignment]
    smap = _LocalMap(Layout.split(n, 1), (_LocalShard(shard),))
    config = ReplicaConfig(
        "run", "sgd", 0.1, None, 1, 1, 0.0, 8, 0, False, None, 1, None, False, 5.0, True
    )  # one step over all 8 rows, in order, with its loss traced

    async def one_step() -> DownpourReplica:
        replica = DownpourReplica(0, model, dataset, 0, 8, smap, config)
        await replica.start()
        deadline = time.monotonic() + 10.0
        while not replica.done and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await replica.stop(5.0)
        return replica

    replica = asyncio.run(one_step())
    assert replica.error is None and replica.stop_reason == "max_steps"
    w_pushed = np.array([1.0, -2.0, 0.5])
    at_pushed, at_x0 = (model.loss_and_grad(w, X, y)[0] / 8 for w in (w_pushed, np.zeros(n)))
    assert abs(at_pushed - at_x0) > 0.1
    assert replica.core.losses == [at_pushed]
