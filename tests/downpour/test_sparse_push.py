"""Downpour with key-value fetch and push: the floats of sequential SGD / Adagrad, and the bytes by hand."""

from __future__ import annotations

import itertools
from typing import Any, Literal

import numpy as np
import pytest
import scipy.sparse as sp
from distributed import Client

from distbelief import downpour, models
from distbelief.downpour import BatchPlan, ReplicaCore, sequential_sgd
from distbelief.errors import InvalidOptionError
from distbelief.storage import Dataset, Shard
from tests.downpour._helpers import global_batches


def _wide(n_rows: int, d: int, nnz: int, seed: int = 0) -> tuple[Any, np.ndarray]:
    rng = np.random.default_rng(seed)
    cols = np.minimum((rng.pareto(1.2, size=(n_rows, nnz)) * 30).astype(np.int64), d - 1)
    X = sp.csr_array(
        (rng.normal(size=cols.size), cols.ravel(), np.arange(0, cols.size + 1, nnz)), shape=(n_rows, d)
    )
    X.sum_duplicates()
    y = (rng.random(n_rows) < 0.4).astype(float)
    return X, y


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Dataset, Any, np.ndarray]:
    X, y = _wide(1500, 1 << 16, 15)
    path = tmp_path_factory.mktemp("downpour-kv") / "wide"
    return Dataset.from_arrays(X, y, path=path, portion_rows=512), X, y


@pytest.mark.parametrize("kind", ["least_squares", "softmax"])
def test_windowed_steps_of_other_linear_models_are_sequential_too(
    client: Client, wide: tuple[Dataset, Any, np.ndarray], kind: str
) -> None:
    # Least squares takes the compiled pass on the rows as they are; a softmax narrows every step's rows.
    ds, X, y = wide
    model = (
        models.LeastSquares(ds.n_features) if kind == "least_squares" else models.Softmax(ds.n_features, 3)
    )
    steps = 40
    res = downpour.train(
        model, ds, replicas=1, shards=2, rule="adagrad", lr=0.1, max_steps=steps, max_staleness=0,
        communication="sparse", n_fetch=1, client=client,
    )  # fmt: skip
    plan = BatchPlan.for_rows(ds, 0, ds.n_rows, batch_size=32, seed=0, replica=0)
    batches = list(itertools.islice(global_batches(plan, 10_000), steps))
    ref = sequential_sgd(model, X, y, model.init_params(0), batches, rule="adagrad", lr=0.1)
    assert res.stats["communication"] == "sparse" and res.steps == steps
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-12, atol=1e-14)
    assert np.abs(ref.x).max() > 0.05  # it moved


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_one_replica_with_max_staleness_0_is_sequential(
    client: Client,
    wide: tuple[Dataset, Any, np.ndarray],
    rule: Literal["sgd", "adagrad"],
    mode: Literal["sparse", "dense"],
) -> None:
    ds, X, y = wide
    model = models.Logistic(ds.n_features)
    steps = 120
    res = downpour.train(
        model, ds, replicas=1, shards=2, rule=rule, lr=0.2, max_steps=steps, max_staleness=0,
        communication=mode, n_fetch=1, client=client,  # a fetch before every step (not auto_sync's 50)
    )  # fmt: skip
    plan = BatchPlan.for_rows(ds, 0, ds.n_rows, batch_size=32, seed=0, replica=0)
    batches = list(itertools.islice(global_batches(plan, 10_000), steps))
    ref = sequential_sgd(model, X, y, model.init_params(0), batches, rule=rule, lr=0.2)
    assert res.stats["communication"] == mode and res.steps == steps
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-12, atol=1e-14)
    assert np.abs(ref.x).max() > 0.05  # it moved
    fetch_requests = res.stats["fetches"] // 2  # counted per shard
    if mode == "sparse":
        # Windowed: under a staleness bound, the fetch sent before step t asks for the keys of steps t and
        # t + 1 (n_fetch = 1: this window and the next), 12 bytes a key; the last one for no step at all.
        step_keys = [set(np.unique(X[rows].indices).tolist()) | {ds.n_features} for rows in batches]
        windows = [step_keys[t] | (step_keys[t + 1] if t + 1 < steps else set()) for t in range(steps)]
        assert fetch_requests == steps + 1
        assert res.stats["bytes_fetched"] == 12 * sum(len(w) for w in windows)
    else:
        assert res.stats["bytes_fetched"] == fetch_requests * 8 * model.n_params
    pushes = res.stats["per_replica"][0]["pushes"]
    if mode == "dense":
        assert res.stats["bytes_pushed"] == pushes[0] * 8 * model.n_params
    else:
        # A push carries the entries one mini-batch of 32 rows x ~15 nonzeros moved: 12 bytes each.
        assert 0 < res.stats["bytes_pushed"] <= pushes[0] * 12 * (32 * 15 + 1)
    assert res.history["bytes_moved"].values[-1] == res.stats["bytes_fetched"] + res.stats["bytes_pushed"]


def test_sparse_needs_l2_zero_and_auto_falls_back(
    client: Client, wide: tuple[Dataset, Any, np.ndarray]
) -> None:
    ds, _, _ = wide
    model = models.Logistic(ds.n_features)
    with pytest.raises(InvalidOptionError, match="communication"):
        downpour.train(model, ds, replicas=1, l2=1e-3, max_steps=5, communication="sparse", client=client)
    res = downpour.train(model, ds, replicas=1, l2=1e-3, max_steps=5, client=client)
    assert res.stats["communication"] == "dense"
    res = downpour.train(model, ds, replicas=1, max_steps=5, client=client)
    assert res.stats["communication"] == "sparse"


def test_core_pushes_only_nonzero_entries_and_fetches_only_keys() -> None:
    core = ReplicaCore([(0, 4), (4, 8)], rule="sgd", lr=0.5)
    core.use_keys([np.array([1], dtype=np.int32), np.array([0, 3], dtype=np.int32)])
    shards = [Shard(0, 0, 4), Shard(1, 4, 8)]
    for s in shards:
        s.set("x", s.lo, s.hi, np.arange(s.lo, s.hi, dtype=float))
    req = core.start_fetch()
    for i, s in enumerate(shards):
        core.on_fetched(req.fid, i, 0, [s.gather("x", core.fetch_keys[i])])  # type: ignore[index]
    assert core.x.tolist() == [0, 1, 0, 0, 4, 0, 0, 7]  # only the keys were fetched
    core.apply(np.array([0, 2.0, 0, 0, 0, 0, 0, -1.0]))
    msg = core.take_push()
    assert msg is not None and msg.keys is not None
    assert [k.tolist() for k in msg.keys] == [[1], [3]] and msg.grad.tolist() == [2.0, -1.0]
    assert core.counters.bytes_fetched == 3 * 12 and core.counters.bytes_pushed == 2 * 12
    with pytest.raises(InvalidOptionError, match="l2 = 0"):
        ReplicaCore([(0, 4)], rule="sgd", lr=0.1, l2=0.1).use_keys([np.array([0])])


def test_a_windowed_runs_history_is_evaluated_at_the_shards_parameters(
    client: Client, wide: tuple[Dataset, Any, np.ndarray]
) -> None:
    # A windowed replica's local copy is exact only at its next steps' keys: its records ask the driver
    # to read the shards instead, so the rows between the first and the last have an objective too: the
    # latest record of a poll gets the shards' parameters, the records before it none (an objective copied
    # onto rows taken at other parameters made them look flat).
    ds, _, _ = wide
    res = downpour.train(
        models.Logistic(ds.n_features), ds, replicas=2, shards=2, rule="adagrad", lr=0.2, max_steps=600,
        n_fetch=5, n_push=5, client=client,
    )  # fmt: skip
    assert res.stats["communication"] == "sparse"
    objective = res.history["objective"].values
    finite = objective[np.isfinite(objective)]
    assert np.isfinite(objective[1:-1]).sum() >= 1, objective
    assert (np.diff(finite) != 0).all(), objective  # no row's objective is another's, copied
    assert objective[-1] < objective[0]
