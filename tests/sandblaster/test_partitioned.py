"""Sandblaster on partitioned replicas: every portion's gradient computed by the model's K partitions,
in one process (``models.PartitionedModel``) or as K partition actors (``minimize(partitions=K)``)."""

from __future__ import annotations

import doctest
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.optimize
import scipy.sparse
from distributed import Client

from distbelief import models, sandblaster
from distbelief.errors import InvalidOptionError
from distbelief.sandblaster import _partitioned
from distbelief.storage import load_digits, worker_addresses

X_ALL, Y_ALL = load_digits()
X, Y = X_ALL[:400], Y_ALL[:400].astype(float)
#: 15 units of 8 inputs (stride 4), then the 10 classes: 295 parameters.
LC = models.LocallyConnected(64, 10, fields=[8], strides=[4])


def test_lbfgs_on_a_partitioned_model_takes_the_same_iterates(client: Client) -> None:
    model = models.LocallyConnected(64, 10, fields=[6, 3], strides=[2, 1])
    kw = {"l2": 1e-2, "maxiter": 8, "replicas": 2, "portions": 4, "client": client, "backups": False}
    whole = sandblaster.minimize(model, (X, Y), **kw)  # type: ignore[arg-type]
    split = sandblaster.minimize(models.PartitionedModel(model, 2), (X, Y), **kw)  # type: ignore[arg-type]
    assert split.nit == whole.nit == 8
    np.testing.assert_allclose(split.x, whole.x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(split.fun, whole.fun, rtol=1e-10)


@pytest.mark.parametrize(
    "model", [LC, models.MLP([64, 6, 10], activation="tanh")], ids=["locally_connected", "mlp"]
)
def test_partition_actors_take_the_iterates_of_one_replica_per_model(client: Client, model: Any) -> None:
    kw: dict[str, Any] = {"l2": 1e-2, "maxiter": 4, "replicas": 2, "portions": 4, "client": client}
    whole = sandblaster.minimize(model, (X, Y), **kw)
    for K in (2, 3, 4) if model is LC else (2,):
        res = sandblaster.minimize(model, (X, Y), partitions=K, **kw)
        assert res.nit == whole.nit == 4 and res.stats["partitions"] == K
        # Not ==: a partitioned pass adds partial products in another order (the locally connected output
        # layer's logits are a sum over partitions, the MLP's input-gradients too) and the shards' dot
        # products are summed over K shards instead of one. Measured: 7e-16 at most after 10 iterations.
        np.testing.assert_allclose(res.x, whole.x, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(res.fun, whole.fun, rtol=1e-12)
        # Each partition fetched only its own slice (the shards aligned to it): K partitions together pull
        # one parameter vector per fetch, not K.
        fetches = int(res.history.fetches.sum())
        assert res.stats["bytes_pulled"] == 8 * model.n_params * fetches
        assert res.stats["shards"] == K


def test_partitioned_lbfgs_reaches_scipys_optimum(client: Client) -> None:
    # l2=0.1: strongly convex enough near the optimum that SciPy's default tolerances pin F to ~1e-10.
    def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
        return models.objective(LC, w, X, Y, l2=0.1)

    x0 = LC.init_params(0)
    ref = scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B", options={"maxcor": 10})
    res = sandblaster.minimize(LC, (X, Y), x0=x0, l2=0.1, partitions=3, replicas=1, portions=1, client=client)
    assert res.success, res.message
    assert res.fun == pytest.approx(ref.fun, rel=1e-8)
    assert abs(res.nit - ref.nit) <= max(2, 0.2 * ref.nit)


@pytest.mark.parametrize(
    ("model", "data", "options", "match"),
    [
        (LC, (X, Y), {"partitions": 0}, "partitions=0"),
        (LC, (X, Y), {"partitions": -2}, "partitions=-2"),
        (LC, (X, Y), {"partitions": 1.5}, "partitions=1.5"),
        (LC, (X, Y), {"partitions": True}, "partitions=True"),
        (LC, (X, Y), {"partitions": "2"}, "partitions='2'"),
        (LC, (X, Y), {"partitions": 16}, "narrowest layer .* has units \\(15\\)"),
        (models.MLP([64, 3, 10]), (X, Y), {"partitions": 4}, "units \\(3\\)"),
        (models.Logistic(64), (X, Y), {"partitions": 2}, "cannot be partitioned"),
        (LC, (scipy.sparse.csr_array(X), Y), {"partitions": 2}, "needs dense rows"),
        (LC, (X, Y), {"partitions": 2, "communication": "sparse"}, "not supported with partitions=2"),
        (LC, (X, Y), {"partitions": 2, "shards": 3}, "multiple of partitions"),
        (LC, (X, Y), {"partitions": 2, "slowdown": {0: 2.0}}, "slowdown"),
    ],
)
def test_bad_partitions_are_refused_before_anything_is_stored(
    tmp_path: Path, model: Any, data: Any, options: dict[str, Any], match: str
) -> None:
    store = tmp_path / "run"
    with pytest.raises(InvalidOptionError, match=match):
        sandblaster.minimize(model, data, store=store, **options)
    assert not store.exists()


def _kill_worker(client: Client, address: str) -> None:
    pids = client.run(os.getpid, workers=[address])
    os.kill(pids[address], signal.SIGKILL)


def test_a_killed_partition_or_shard_worker_changes_nothing_in_the_answer(client: Client) -> None:
    shards_on, other = worker_addresses(client)
    kw: dict[str, Any] = {
        "l2": 1e-2, "maxiter": 8, "replicas": 2, "portions": 4, "partitions": 2, "client": client,
        "shard_workers": [shards_on], "replica_workers": [shards_on, other],
    }  # fmt: skip
    plain = sandblaster.minimize(LC, (X, Y), **kw)
    killed: list[int] = []

    def kill(record: sandblaster.IterationRecord) -> None:
        if record.iteration == 3 and not killed:
            killed.append(record.iteration)
            _kill_worker(client, other)  # one partition of each replica (the shards live on)

    res = sandblaster.minimize(LC, (X, Y), callback=kill, **kw)
    assert killed and res.nit == plain.nit == 8
    # Both replicas lost a partition; each was rebuilt on the live worker, none was given up.
    assert sorted(r for r, _ in res.stats["rebuilt_partitions"]) == [0, 1]
    assert res.stats["lost_replicas"] == []
    # The same answer, bit for bit: every portion's loss and gradient slices are the same numbers whoever
    # computes them, and the shards sum exactly.
    assert res.fun == plain.fun
    assert np.array_equal(res.x, plain.x)
    np.testing.assert_array_equal(res.history.objective.values, plain.history.objective.values)

    # A lost *shard* (its worker killed): rebuilt from the last checkpoint, every shard rolled back to it,
    # every partition of every replica repointed at the new shards (the head tells its peers); same answer.
    client.wait_for_workers(2, timeout=60)
    keep, shards_on = worker_addresses(client)
    lost: list[int] = []

    def kill_shards(record: sandblaster.IterationRecord) -> None:
        if record.iteration == 5 and not lost:
            lost.append(record.iteration)
            _kill_worker(client, shards_on)

    kw |= {"shard_workers": [shards_on], "replica_workers": [keep], "checkpoint_every": 2}
    again = sandblaster.minimize(LC, (X, Y), callback=kill_shards, **kw)
    assert lost and again.stats["recoveries"] == 1 and again.nit == plain.nit
    assert again.fun == plain.fun and np.array_equal(again.x, plain.x)


def test_examples_run() -> None:
    result = doctest.testmod(
        _partitioned, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.attempted > 0 and result.failed == 0


def test_a_partition_counts_the_bytes_of_a_binned_push(tmp_path: Path) -> None:
    # A summed group travels as an exact-sum state (storage._exactsum: 4 rows a parameter), not a vector.
    import asyncio

    from distbelief.sandblaster._messages import WorkCall
    from distbelief.storage import Dataset, Layout
    from distbelief.storage.internal import exactsum

    model = models.MLP([3, 4, 2])
    plan = models.partition_plan(model, 2)
    n = plan.bounds[-1]
    ds = Dataset.from_arrays(np.ones((4, 3)), np.zeros(4), path=tmp_path / "d")

    class Map:
        layout = Layout(n=n, chunk=1, bounds=tuple(plan.bounds))

        async def ask(self, *args: Any, **kwargs: Any) -> tuple[bool, None]:
            return True, None

    part = _partitioned.SandblasterPartition(0, 1, plan, ds, Map(), [1])  # type: ignore[arg-type]
    size = plan.bounds[2] - plan.bounds[1]
    binned = exactsum.deposit(exactsum.zeros(size), np.ones(size))

    async def push() -> None:
        for grad, solo in ((np.ones(size), True), (binned, False)):
            call = WorkCall(1, "x", "acc", (0, 1), solo=solo)
            await asyncio.gather(*(f for _, f in part._push(call, [0, 1], grad)))

    asyncio.run(push())
    part._compute.shutdown()
    assert part.bytes_pushed == 8 * size + binned.nbytes


def test_a_partitions_shard_calls_stretch_the_timeout_once(tmp_path: Path, monkeypatch: Any) -> None:
    # minimize(partitions=K) hands the partitions ps.timeout, already stretched for wide shards
    # (storage.scaled_timeout): the shard calls must not stretch it again (8x became 64x at 2**26 a shard).
    import asyncio

    from distbelief.sandblaster._messages import WorkCall
    from distbelief.storage import Dataset, Layout, ShardMap, _server

    layout = Layout.split(1 << 27, 2)  # 2**26 parameters a shard: the timeout is stretched 8 times
    stretched = _server.scaled_timeout(60.0, layout)
    assert stretched == 480.0
    waits: list[float | None] = []

    async def await_call(call: Any, *, timeout: float | None, **kwargs: Any) -> Any:
        call.close()  # never sent: only the timeout it would be awaited with matters here
        waits.append(timeout)
        return True, [np.zeros(1)], []

    monkeypatch.setattr(_server, "await_call", await_call)
    plan = models.partition_plan(models.MLP([3, 4, 2]), 2)
    ds = Dataset.from_arrays(np.ones((4, 3)), np.zeros(4), path=tmp_path / "d")
    shard_map = ShardMap(layout, (object(), object()))
    part = _partitioned.SandblasterPartition(0, 1, plan, ds, shard_map, [1], stretched)
    call = WorkCall(1, "x", "acc", (0, 1), solo=True)

    async def fetch_and_push() -> None:
        await part._fetch_own(1, "x", [])
        await asyncio.gather(*(f for _, f in part._push(call, [0, 1], np.ones(4))))

    try:
        asyncio.run(fetch_and_push())
    finally:
        part._compute.shutdown()
    assert waits == [stretched, stretched]


def test_a_failed_rebuild_is_logged_with_its_workers_and_cause(caplog: Any, monkeypatch: Any) -> None:
    # The replica is still given up (its work goes to the others), but why is no longer dropped silently.
    import asyncio
    import logging

    class Group:
        places = ("tcp://w0", "tcp://w1")

        def dead(self) -> list[int]:
            return [1]

    class Machine:
        def lose(self, r: int) -> list[Any]:
            return [("lost", r)]

    async def rebuild(*args: Any) -> None:
        raise MemoryError("no room for the partition's rows")

    sched = object.__new__(_partitioned.PartitionedScheduler)
    sched.replicas = [(None, Group())]  # type: ignore[list-item]  # a fake of the replica group
    sched.workers = ["tcp://w0", "tcp://w1", "tcp://w2"]
    sched.machine, sched._rebuilds, sched.max_rebuilds = Machine(), 0, 3  # type: ignore[assignment]
    monkeypatch.setattr(sched, "_rebuild", rebuild)
    with caplog.at_level(logging.WARNING, logger="distbelief.sandblaster._partitioned"):
        sent: list[Any] = asyncio.run(sched._replica_lost(0))  # the fake machine's answer, passed on
        assert sent == [("lost", 0)]
    (record,) = caplog.records
    text = record.getMessage()
    assert record.levelno == logging.WARNING and "replica 0" in text and "partition 1" in text
    assert "tcp://w1" in text and "tcp://w0" in text and "no room for the partition's rows" in text
