"""End to end: Sandblaster on a sparse dataset gives what it gives on the dense copy of the same rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from distributed import Client

from distbelief import models, sandblaster
from distbelief.storage import Dataset


def test_lbfgs_on_sparse_rows_equals_lbfgs_on_their_dense_copy(client: Client, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n, d = 600, 300
    X = sp.random_array((n, d), density=0.03, format="csr", rng=rng)
    X.data = rng.normal(size=X.nnz)
    w_true = rng.normal(size=d)
    y = (rng.random(n) < 1 / (1 + np.exp(-(X @ w_true)))).astype(float)
    model = models.Logistic(d)
    sparse_ds = Dataset.from_arrays(X, y, path=tmp_path / "sparse", portion_rows=64)
    dense_ds = Dataset.from_arrays(X.toarray(), y, path=tmp_path / "dense", portion_rows=64)
    assert sparse_ds.layout == "csr" and dense_ds.layout == "dense" and sparse_ds.n_portions == 10
    runs = {
        name: sandblaster.minimize(
            model, ds, l2=1e-3, client=client, store=tmp_path / f"run-{name}", gtol=1e-8
        )
        for name, ds in (("sparse", sparse_ds), ("dense", dense_ds))
    }
    sparse_run, dense_run = runs["sparse"], runs["dense"]
    assert sparse_run.success and dense_run.success, (sparse_run.message, dense_run.message)
    assert sparse_run.nit == dense_run.nit and sparse_run.nit > 5
    assert sparse_run.fun == pytest.approx(dense_run.fun, rel=1e-10)
    np.testing.assert_allclose(sparse_run.x, dense_run.x, rtol=1e-10, atol=1e-10)
    # And the optimum is the optimum of the problem (not just the same wrong answer twice).
    _, grad = models.objective(model, sparse_run.x, X.toarray(), y, l2=1e-3)
    assert np.abs(grad).max() < 1e-5  # from ~0.1 at the start


def test_a_tuple_with_sparse_rows_becomes_a_sparse_dataset(client: Client, tmp_path: Path) -> None:
    X = sp.csr_array(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    y = np.array([1.0, 0.0, 1.0, 0.0])
    res = sandblaster.minimize(models.Logistic(2), (X, y), l2=0.1, client=client, store=tmp_path / "run")
    assert res.success and Dataset.open(tmp_path / "run" / "data").layout == "csr"
    ref = sandblaster.minimize(
        models.Logistic(2), (X.toarray(), y), l2=0.1, client=client, store=tmp_path / "r2"
    )
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-10, atol=1e-12)


def test_runs_of_models_with_other_layouts_on_one_sparse_dataset_do_not_share_portion_keys(
    client: Client, tmp_path: Path
) -> None:
    # The replicas' row cache outlives a run; what it derives from a portion (its parameter keys) depends
    # on the model's layout. A run with an intercept (keys up to d) followed by one without (n_params = d)
    # used the first run's keys and failed with an index out of bounds.
    rng = np.random.default_rng(3)
    n, d = 200, 40
    X = sp.random_array((n, d), density=0.1, format="csr", rng=rng)
    y = (rng.random(n) < 0.5).astype(float)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "data", portion_rows=50)
    for i, (intercept, k) in enumerate(((True, 1), (False, 1), (False, 3), (True, 3))):
        model: models.Model = (
            models.Logistic(d, fit_intercept=intercept)
            if k == 1
            else models.Softmax(d, k, fit_intercept=intercept)
        )
        yy = y if k == 1 else (np.arange(n) % k).astype(float)
        data = ds if k == 1 else Dataset.from_arrays(X, yy, path=tmp_path / f"data{i}", portion_rows=50)
        res = sandblaster.minimize(model, data, l2=0.1, client=client, store=tmp_path / f"run{i}")
        ref = sandblaster.minimize(
            model, (X.toarray(), yy), l2=0.1, client=client, store=tmp_path / f"ref{i}"
        )
        assert res.success, res.message
        np.testing.assert_allclose(res.x, ref.x, rtol=1e-8, atol=1e-10)
