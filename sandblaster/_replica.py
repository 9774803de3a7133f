"""A Sandblaster model replica: computes gradient portions and pushes them to the shards (paper, section 4.2).

A replica is a Dask actor. :meth:`Replica.work` is synchronous, so it runs in the worker's actor thread and
never blocks the worker's event loop, where the shards' ops run. It fetches the parameters once per
evaluation, computes the loss and gradient of the portions it is given, and pushes their summed gradient to
the shards before it reports, so what it reports is already safe on the shards: a replica that dies costs
only the portions it had not pushed. Backup copies and recomputed portions are pushed *solo* (one portion
per push); the shards count every portion exactly once whichever copies arrive (``Shard.accumulate``).

Data affinity: portions read once stay in memory, and the scheduler gives a replica the same portions again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.linalg import blas

from errors import ClusterError
from storage import Dataset, ShardMap

__all__ = ["Replica"]


class Replica:
    """Dask actor computing portions of ``sum_i loss_i`` and its gradient for the coordinator.

    Parameters
    ----------
    index : int
        Replica number.
    model : Model
        Anything with ``loss_and_grad(w, X, y)``.
    dataset : storage.Dataset
        The training rows, split into portions.
    shard_map : storage.ShardMap
        Where to fetch parameters from and push gradients to.
    preload : sequence of int
        Portions to read into memory now (the ones this replica will most likely be given).
    slowdown : float
        Fault injection for tests and benchmarks: after computing a portion in ``t`` seconds, sleep
        ``(slowdown - 1) * t``, so this replica is ``slowdown`` times slower than it would be.
    """

    def __init__(
        self,
        index: int,
        model: Any,
        dataset: Dataset,
        shard_map: ShardMap,
        preload: Sequence[int] = (),
        slowdown: float = 1.0,
    ) -> None:
        self.index = index
        self.model = model
        self.dataset = dataset
        self.shards = shard_map
        self.slowdown = float(slowdown)
        self.cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._eval_id: int | None = None
        self._w: np.ndarray | None = None
        self.fetches = 0
        for p in preload:
            self._portion(p)

    def _portion(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        data = self.cache.get(p)
        if data is None:
            data = self.cache[p] = self.dataset.read_portion(p)
        return data

    def _push(
        self, acc_name: str, values: np.ndarray, portions: list[int], epoch: int, solo: bool
    ) -> list[tuple[int, Any]]:
        return [
            (i, self.shards.call(i, "accumulate", acc_name, part, portions, epoch, solo))
            for i, part in enumerate(self.shards.slices(values))
        ]

    def work(
        self,
        eval_id: int,
        x_name: str,
        acc_name: str,
        assign: Sequence[int],
        solo: bool = False,
        prep: Sequence[Sequence[Any]] = (),
    ) -> dict[str, Any]:
        """Compute the portions ``assign`` at the parameters ``x_name`` and push their gradient.

        The first call of an evaluation fetches ``x_name`` from the shards (once per evaluation); the
        coordinator's ``prep`` ops for this evaluation (forming ``x_name``, zeroing the accumulator) ride on
        that fetch and run once on each shard, whichever replica comes first. With ``solo`` every portion
        is pushed alone (backup copies, recomputations); otherwise their sum is pushed in one message to
        each shard. Returns ``{"results": [(portion, loss, rows), ...], "prep": [...], ...}`` once every
        shard has the gradient.
        """
        t0 = time.perf_counter()
        fetched = self._eval_id != eval_id
        prep_results: list[Any] = []
        if fetched:
            try:
                (self._w,), prep_results = self.shards.prepare_and_fetch(eval_id, prep, [x_name])
            except Exception as exc:
                raise ClusterError(f"replica {self.index} could not fetch from the shards: {exc!r}") from exc
            self._eval_id = eval_id
            self.fetches += 1
        w = self._w
        assert w is not None
        t1 = time.perf_counter()
        results = []
        total: np.ndarray | None = None
        calls: list[tuple[int, Any]] = []
        for p in assign:
            start = time.perf_counter()
            X, y = self._portion(p)
            loss, grad = self.model.loss_and_grad(w, X, y)
            grad = np.asarray(grad, dtype=np.float64)
            if self.slowdown > 1.0:
                time.sleep((self.slowdown - 1.0) * (time.perf_counter() - start))
            results.append((int(p), float(loss), int(X.shape[0])))
            if solo:
                calls += self._push(acc_name, grad, [int(p)], eval_id, True)
            elif total is None:
                total = grad.copy()
            else:
                blas.daxpy(grad, total, a=1.0)
        t2 = time.perf_counter()
        if total is not None:
            calls += self._push(acc_name, total, [int(p) for p in assign], eval_id, False)
        final: dict[int, list[Any]] = {}
        try:
            for shard, call in calls:
                _, finalized = self.shards.wait(shard, call)
                if finalized is not None:
                    final[shard] = finalized  # this push completed the shard's evaluation
        except Exception as exc:
            raise ClusterError(f"replica {self.index} could not push to the shards: {exc!r}") from exc
        return {
            "results": results,
            "prep": prep_results,
            "final": final,
            "fetched": fetched,
            "fetch_s": t1 - t0,
            "compute_s": t2 - t1,
            "push_s": time.perf_counter() - t2,
        }

    async def stats(self) -> dict[str, Any]:
        """Counters for tests and benchmarks."""
        return {"fetches": self.fetches, "cached_portions": sorted(self.cache)}

    async def set_shards(self, shard_map: ShardMap) -> None:
        """Talk to these shards from now on (after lost shards were rebuilt on other workers)."""
        self.shards = shard_map
        self._eval_id = None

    async def set_slowdown(self, slowdown: float) -> None:
        """Change the injected slowdown (fault injection)."""
        self.slowdown = float(slowdown)
