"""Sparse rows through the estimators: scipy.sparse input of any format, Datasets of sparse rows, predictions
of sparse rows, and the same fits as on the dense copy (the sparse pull/push path on the cluster)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import sklearn.linear_model as sk
from distributed import Client

from distbelief.sklearn import LinearRegression, LogisticRegression, MLPClassifier, SoftmaxRegression
from distbelief.storage import Dataset


def _problem(n: int = 300, d: int = 60, k: int = 2, seed: int = 0) -> tuple[sp.csr_array, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = sp.random_array((n, d), density=0.08, format="csr", rng=rng)
    X.data = rng.normal(size=X.nnz)
    W = rng.normal(size=(d, k))
    y = np.argmax(X @ W + rng.gumbel(size=(n, k)), axis=1)
    return sp.csr_array(X), y


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "lil", "matrix"])
def test_logistic_on_sparse_rows_equals_the_fit_on_their_dense_copy(fmt: str, client: Client) -> None:
    X, y = _problem()
    Xs = sp.csr_matrix(X) if fmt == "matrix" else X.asformat(fmt)
    # On the cluster (given): its sparse pull and push; without a client this small fit runs in-process.
    sparse_fit = LogisticRegression(C=0.5, tol=1e-10, max_iter=500, client=client).fit(Xs, y)
    dense_fit = LogisticRegression(C=0.5, tol=1e-10, max_iter=500).fit(X.toarray(), y)
    assert sparse_fit.result_.stats["communication"] == "sparse"
    assert dense_fit.result_.stats["local"] is True
    np.testing.assert_allclose(sparse_fit.coef_, dense_fit.coef_, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(sparse_fit.intercept_, dense_fit.intercept_, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(sparse_fit.predict_proba(Xs), dense_fit.predict_proba(X.toarray()))
    np.testing.assert_allclose(sparse_fit.decision_function(X), dense_fit.decision_function(X.toarray()))
    np.testing.assert_array_equal(sparse_fit.predict(Xs), dense_fit.predict(X.toarray()))


def test_sparse_fit_matches_sklearn_lbfgs() -> None:
    X, y = _problem(k=3, seed=1)
    ours = SoftmaxRegression(C=2.0, tol=1e-10, max_iter=1000).fit(X, y)
    ref = sk.LogisticRegression(C=2.0, tol=1e-12, max_iter=5000).fit(X, y)
    np.testing.assert_allclose(ours.predict_proba(X), ref.predict_proba(X), atol=1e-6)


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_a_dataset_of_sparse_rows_fits_as_the_sparse_matrix(tmp_path: Path, fit_intercept: bool) -> None:
    # Before: FreeParams (the wrapper that leaves the intercept unpenalized) reached the sparse path, which
    # rebuilt type(model) from model.spec: "FreeParams.__init__() got an unexpected keyword 'n_features'".
    X, y = _problem(seed=2)
    ds = Dataset.from_arrays(X, y.astype(float), path=tmp_path / "d", label_kind="binary", portion_rows=64)
    assert ds.layout == "csr"
    est = LogisticRegression(C=0.5, tol=1e-10, max_iter=500, fit_intercept=fit_intercept)
    from_ds = est.fit(ds)
    assert from_ds.result_.stats["communication"] == "sparse"
    from_matrix = LogisticRegression(**est.get_params()).fit(X, y)
    np.testing.assert_allclose(from_ds.coef_, from_matrix.coef_, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(from_ds.intercept_, from_matrix.intercept_, rtol=1e-8, atol=1e-10)


def test_least_squares_on_sparse_rows_matches_ridge() -> None:
    X, _ = _problem(seed=3)
    rng = np.random.default_rng(3)
    t = X @ rng.normal(size=X.shape[1]) + 1.5 + 0.1 * rng.normal(size=X.shape[0])
    ours = LinearRegression(alpha=2.0, tol=1e-10, max_iter=1000).fit(X, t)
    ref = sk.Ridge(alpha=2.0, solver="lsqr", tol=1e-12).fit(X, t)
    np.testing.assert_allclose(ours.coef_, ref.coef_, atol=1e-6)
    np.testing.assert_allclose(ours.predict(X), ref.predict(X), atol=1e-6)


def test_bad_sparse_input_is_refused_clearly() -> None:
    X, y = _problem(seed=4)
    bad = X.copy()
    bad.data[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        LogisticRegression().fit(bad, y)
    est = LogisticRegression(max_iter=5).fit(X, y)
    with pytest.raises(ValueError, match=f"{X.shape[1]} features"):
        est.predict(sp.csr_array((2, X.shape[1] + 1)))
    with pytest.raises(ValueError, match="NaN"):
        est.predict_proba(bad)


def test_the_mlp_says_it_takes_dense_rows() -> None:
    # No sparse kernel in models.MLP: refused before anything runs, as scikit-learn refuses it.
    X, y = _problem(n=20, d=5, seed=5)
    with pytest.raises(TypeError, match="dense data is required"):
        MLPClassifier(hidden_layer_sizes=(3,)).fit(X, y)


def test_fits_of_other_layouts_and_penalties_on_one_sparse_dataset(tmp_path: Path) -> None:
    # The workers' row cache outlives a fit: what it keeps of a portion must not carry one fit's layout
    # (an intercept, before: "index out of bounds" in the next fit without one) or one fit's penalty
    # (the narrowed model's l2) into the next.
    X, y = _problem(seed=6)
    ds = Dataset.from_arrays(X, y.astype(float), path=tmp_path / "d", label_kind="binary", portion_rows=64)
    for params in (
        {"C": 0.1},
        {"C": 0.1, "fit_intercept": False},
        {"C": 10.0},
        {"C": 1.0, "penalty": "l1"},
    ):
        est = LogisticRegression(tol=1e-10, max_iter=1000, **params)
        on_ds = est.fit(ds)
        assert on_ds.result_.stats["communication"] == "sparse"
        dense = LogisticRegression(**est.get_params()).fit(X.toarray(), y)
        np.testing.assert_allclose(on_ds.coef_, dense.coef_, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(on_ds.intercept_, dense.intercept_, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("empty", [False, True])
def test_free_params_narrowed_to_a_portion_gives_the_full_gradient_at_its_keys(empty: bool) -> None:
    # The sparse path computes a portion with the wrapper narrowed to the portion's keys; its loss and
    # gradient must be the full wrapper's at those keys (the free ranges moved with them), also for a
    # portion without a nonzero (one placeholder column whose coefficients are not among the keys).
    from distbelief import models
    from distbelief.sklearn._base import FreeParams
    from distbelief.storage._keys import compact_portion

    rng = np.random.default_rng(7)
    d, k = 30, 3
    X = sp.csr_array((4, d)) if empty else sp.random_array((4, d), density=0.1, format="csr", rng=rng)
    y = np.array([0.0, 1.0, 2.0, 1.0])
    full = FreeParams(models.Softmax(d, k), 0.3, [(d * k, d * k + k)])
    w = rng.normal(size=full.n_params)
    part = compact_portion(full, X, y)
    loss, grad = part.model.loss_and_grad(w[part.keys], part.X, part.y)
    loss_full, grad_full = full.loss_and_grad(w, X, y)
    assert loss == pytest.approx(loss_full, rel=1e-12)
    np.testing.assert_allclose(grad, grad_full[part.keys], rtol=1e-12, atol=1e-14)
    untouched = np.setdiff1d(np.arange(full.n_params), part.keys)
    assert np.all(grad_full[untouched] == 0.0)
