"""Sparse pull and push in Sandblaster: the iterates of dense communication, and the bytes counted by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import scipy.sparse as sp
from distributed import Client

from distbelief import models, sandblaster
from distbelief.errors import InvalidOptionError
from distbelief.storage import Dataset


def _wide(n_rows: int, d: int, nnz_per_row: int, seed: int = 0) -> tuple[Any, np.ndarray]:
    """CSR rows with ``nnz_per_row`` power-law-distributed columns each (a hashed-feature shape)."""
    rng = np.random.default_rng(seed)
    cols = np.minimum((rng.pareto(1.2, size=(n_rows, nnz_per_row)) * 50).astype(np.int64), d - 1)
    indptr = np.arange(0, n_rows * nnz_per_row + 1, nnz_per_row)
    X = sp.csr_array((rng.normal(size=cols.size), cols.ravel(), indptr), shape=(n_rows, d))
    X.sum_duplicates()
    X.sort_indices()
    w_true = rng.normal(size=d)
    y = (rng.random(n_rows) < 1 / (1 + np.exp(-(X @ w_true)))).astype(float)
    return X, y


def _run(
    ds: Dataset, model: Any, client: Client, path: Path, mode: Literal["sparse", "dense"], **kw: Any
) -> Any:
    return sandblaster.minimize(
        model, ds, l2=1e-2, client=client, store=path / mode, communication=mode, maxiter=8, **kw
    )


def test_sparse_communication_gives_the_dense_iterates(client: Client, tmp_path: Path) -> None:
    """One replica: the shards add the pushes in the same order, so every float is the same."""
    X, y = _wide(800, 4000, 12)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", portion_rows=100)
    model = models.Logistic(4000)
    runs = {m: _run(ds, model, client, tmp_path, m, replicas=1, backups=False) for m in ("sparse", "dense")}
    sparse, dense = runs["sparse"], runs["dense"]
    assert sparse.stats["communication"] == "sparse" and dense.stats["communication"] == "dense"
    assert sparse.nit == dense.nit >= 5 and sparse.nfev == dense.nfev
    np.testing.assert_array_equal(sparse.x, dense.x)
    np.testing.assert_array_equal(sparse.history["objective"].values, dense.history["objective"].values)
    assert sparse.stats["bytes_per_evaluation"] < dense.stats["bytes_per_evaluation"]


def test_sparse_communication_with_two_replicas_and_backups(client: Client, tmp_path: Path) -> None:
    """Pushes race (and backups go solo): the sums differ only in their order, by rounding."""
    X, y = _wide(1200, 3000, 10, seed=1)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", portion_rows=100)
    model = models.Softmax(3000, 2)  # two parameters a column: keys 2c and 2c + 1
    sparse = _run(ds, model, client, tmp_path, "sparse", replicas=2, portions=12)
    dense = _run(ds, model, client, tmp_path, "dense", replicas=2, portions=12)
    assert sparse.stats["communication"] == "sparse"
    assert sparse.nit == dense.nit >= 5
    np.testing.assert_allclose(sparse.x, dense.x, rtol=1e-12, atol=1e-12)
    # And the run optimizes the problem, not the same wrong thing twice.
    g0 = models.objective(model, np.zeros(model.n_params), X.toarray(), y, l2=1e-2)[1]
    g = models.objective(model, sparse.x, X.toarray(), y, l2=1e-2)[1]
    assert np.abs(g).max() < 0.2 * np.abs(g0).max()


def test_bytes_moved_are_the_count_by_hand(client: Client, tmp_path: Path) -> None:
    """2**18 features, 20 nonzeros a row, one portion: a pull and a push of 12 bytes a key (int32 key,
    float64 value) per evaluation, against 8 bytes a parameter each way dense."""
    d = 1 << 18
    X, y = _wide(400, d, 20, seed=2)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d")
    model = models.Logistic(d)
    keys = np.unique(X.indices).size + 1  # and the intercept
    sparse = _run(ds, model, client, tmp_path, "sparse", replicas=1, portions=1, backups=False)
    dense = _run(ds, model, client, tmp_path, "dense", replicas=1, portions=1, backups=False)
    assert sparse.stats["portions"] == 1 and sparse.nfev >= 3
    assert sparse.stats["bytes_pulled"] == sparse.nfev * 12 * keys
    assert sparse.stats["bytes_pushed"] == sparse.nfev * 12 * keys
    assert sparse.stats["bytes_per_evaluation"] == 24 * keys
    # Where the replicas' time went: gradient work, and waits for fetches and pushes (for benchmarks).
    assert 0 < sparse.stats["replica_compute_s"] < sparse.stats["wall_s"]
    assert sparse.stats["replica_fetch_s"] > 0 and sparse.stats["replica_push_s"] > 0
    assert dense.stats["bytes_per_evaluation"] == 16 * model.n_params
    assert sparse.stats["bytes_per_evaluation"] < dense.stats["bytes_per_evaluation"] / 20
    np.testing.assert_array_equal(sparse.x, dense.x)


def test_keys_that_cover_most_of_a_shard_travel_as_its_whole_slice(client: Client, tmp_path: Path) -> None:
    """40 columns, rows of 10 nonzeros, one portion: the keys cover every parameter, so each pull and push
    moves the whole slice (8 bytes a parameter, as dense; 12 a key would be more), with the dense iterates."""
    X, y = _wide(300, 40, 10, seed=3)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d")
    model = models.Logistic(40)
    assert np.unique(X.indices).size == 40
    sparse = _run(ds, model, client, tmp_path, "sparse", replicas=1, portions=1, backups=False)
    dense = _run(ds, model, client, tmp_path, "dense", replicas=1, portions=1, backups=False)
    assert sparse.stats["communication"] == "sparse" and sparse.nfev >= 3
    assert sparse.stats["bytes_pulled"] == sparse.nfev * 8 * model.n_params
    assert sparse.stats["bytes_pushed"] == sparse.nfev * 8 * model.n_params
    assert sparse.stats["bytes_per_evaluation"] == dense.stats["bytes_per_evaluation"]
    np.testing.assert_array_equal(sparse.x, dense.x)


def test_sparse_communication_needs_sparse_rows_and_a_linear_model(client: Client, tmp_path: Path) -> None:
    X = np.random.default_rng(0).normal(size=(50, 4))
    y = (X[:, 0] > 0).astype(float)
    model = models.Logistic(4)
    with pytest.raises(InvalidOptionError, match="needs a sparse"):
        sandblaster.minimize(model, (X, y), client=client, store=tmp_path / "a", communication="sparse")
    with pytest.raises(InvalidOptionError, match="communication"):
        sandblaster.minimize(model, (X, y), client=client, store=tmp_path / "b", communication="x")  # type: ignore[arg-type]
    # auto on dense rows is dense
    res = sandblaster.minimize(model, (X, y), client=client, store=tmp_path / "c", maxiter=3)
    assert res.stats["communication"] == "dense"
