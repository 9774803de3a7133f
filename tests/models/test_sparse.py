"""Linear models on CSR rows: the compiled pass and its scipy fallback against the dense path and finite
differences; MLP refuses sparse rows with a message."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief import models
from distbelief.errors import DatasetError
from distbelief.models import MLP, LeastSquares, Logistic, Softmax, _compiled
from distbelief.storage._sparse import freeze
from tests.models._helpers import assert_gradient_matches

FAST = settings(max_examples=30, deadline=None)


def _problem(
    kind: str, n: int, d: int, k: int, intercept: bool, seed: int
) -> tuple[Any, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "least_squares":
        model: Any = LeastSquares(d, fit_intercept=intercept)
        y: np.ndarray = rng.normal(size=n)
    elif kind == "logistic":
        model = Logistic(d, fit_intercept=intercept)
        y = rng.integers(0, 2, size=n).astype(float)
    else:
        model = Softmax(d, k, fit_intercept=intercept)
        y = rng.integers(0, k, size=n)
    return model, rng.normal(size=model.n_params), y


def _sparse(n: int, d: int, density: float, seed: int, index_dtype: Any) -> sp.csr_array:
    X = sp.random_array((n, d), density=density, format="csr", rng=np.random.default_rng(seed + 1))
    X.data = np.random.default_rng(seed + 2).normal(size=X.nnz)  # negative values too
    return sp.csr_array((X.data, X.indices.astype(index_dtype), X.indptr.astype(index_dtype)), shape=(n, d))


kinds = st.sampled_from(["least_squares", "logistic", "softmax"])


@FAST
@given(
    kind=kinds,
    n=st.integers(1, 40),
    d=st.integers(1, 30),
    k=st.integers(2, 5),
    density=st.floats(0.0, 1.0),
    intercept=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    index_dtype=st.sampled_from([np.int32, np.int64]),
    compiled=st.sampled_from(["fused", "two sweeps", "scipy"]),
)
def test_sparse_rows_give_the_dense_loss_and_gradient(
    kind: str, n: int, d: int, k: int, density: float, intercept: bool, seed: int, index_dtype: Any,
    compiled: str,
) -> None:  # fmt: skip
    model, w, y = _problem(kind, n, d, k, intercept, seed)
    X = _sparse(n, d, density, seed, index_dtype)
    dense_loss, dense_grad = model.loss_and_grad(w, X.toarray(), y)
    with pytest.MonkeyPatch.context() as mp:
        if compiled == "scipy":  # the fallback without numba: scipy's sparse products
            mp.setattr(_compiled, "sparse_kernel", lambda kind: None)
        elif compiled == "two sweeps":  # what wide models (coef + grad past the cache) take
            mp.setattr(_compiled, "_CSR_FUSED_MAX_BYTES", 0)
        loss, grad = model.loss_and_grad(w, X, y)
    assert loss == pytest.approx(dense_loss, rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, dense_grad, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(dense_grad).max()))


@FAST
@given(
    kind=st.sampled_from(["least_squares", "logistic"]),
    n=st.integers(1, 40),
    d=st.integers(1, 30),
    density=st.floats(0.0, 1.0),
    intercept=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    index_dtype=st.sampled_from([np.int32, np.int64]),
)
def test_a_steps_rows_give_the_loss_and_the_residuals_of_those_rows(
    kind: str, n: int, d: int, density: float, intercept: bool, seed: int, index_dtype: Any
) -> None:
    model, w, y = _problem(kind, n, d, 2, intercept, seed)
    X = _sparse(n, d, density, seed, index_dtype)
    rows = np.random.default_rng(seed).permutation(n)[: max(1, n // 2)].astype(np.int64)
    got = model.rows_residuals(w, X, y, rows)
    assert got is not None
    loss, residuals = got
    want_loss, want_grad = model.loss_and_grad(w, X[rows], y[rows])
    assert loss == want_loss  # the rows' losses added in the same order
    assert residuals.shape == (rows.size,)
    # The gradient they give, against the model's own on the rows.
    grad = np.asarray(X[rows].T @ residuals)
    if intercept:
        grad = np.append(grad, residuals.sum())
    np.testing.assert_allclose(grad, want_grad, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(want_grad).max()))


def test_a_steps_rows_refuse_bad_labels_and_leave_what_they_cannot_do_to_the_narrowed_path() -> None:
    X = sp.csr_array(np.array([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]]))
    rows = np.array([0, 1])
    with pytest.raises(DatasetError, match="binary labels 0 or 1"):
        Logistic(3).rows_residuals(np.zeros(4), X, np.array([0.0, 2.0]), rows)
    assert Softmax(3, 3).rows_residuals(np.zeros(12), X, np.array([0, 2]), rows) is None
    assert Logistic(3).rows_residuals(np.zeros(4), X.toarray(), np.array([0, 1]), rows) is None
    assert Logistic(4).rows_residuals(np.zeros(5), X, np.array([0, 1]), rows) is None  # width


def test_the_compiled_kernel_is_the_one_used() -> None:
    # Otherwise the test above would compare the scipy fallback with itself twice.
    assert _compiled.sparse_kernel("logistic") is not None and _compiled.sparse_kernel("softmax") is not None
    calls: list[str] = []
    real = _compiled.sparse_kernel

    def spy(kind: Any) -> Any:
        calls.append(kind)
        return real(kind)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_compiled, "sparse_kernel", spy)
        for kind in ("least_squares", "logistic", "softmax"):
            model, w, y = _problem(kind, 20, 8, 3, True, 0)
            model.loss_and_grad(w, _sparse(20, 8, 0.3, 0, np.int32), y)
    assert calls == ["least_squares", "logistic", "softmax"]


@settings(max_examples=15, deadline=None)
@given(
    kind=kinds, n=st.integers(1, 10), d=st.integers(1, 6), intercept=st.booleans(), seed=st.integers(0, 999)
)
def test_sparse_gradients_match_finite_differences(
    kind: str, n: int, d: int, intercept: bool, seed: int
) -> None:
    model, w, y = _problem(kind, n, d, 3, intercept, seed)
    assert_gradient_matches(model, w, _sparse(n, d, 0.5, seed, np.int32), y)


def test_unsorted_duplicate_coo_and_matrix_inputs_mean_what_scipy_means() -> None:
    model, w, y = _problem("softmax", 3, 4, 3, True, 0)
    # Row 0 holds column 2 twice (they add up) and its columns out of order.
    data, indices, indptr = (
        np.array([1.0, 2.0, 0.5, -1.0, 3.0]),
        np.array([2, 0, 2, 1, 3]),
        np.array([0, 3, 4, 5]),
    )
    X = sp.csr_matrix((data, indices, indptr), shape=(3, 4))
    dense = X.toarray()
    assert dense[0, 2] == 1.5
    expected = model.loss_and_grad(w, dense, y)
    for rows in (X, sp.csr_array(X), X.tocoo(), sp.csc_array(X), X.astype(np.float32).astype(np.float64)):
        loss, grad = model.loss_and_grad(w, rows, y)
        assert loss == pytest.approx(expected[0], rel=1e-12)
        np.testing.assert_allclose(grad, expected[1], rtol=1e-12, atol=1e-14)


def test_read_only_rows_predictions_and_the_objective() -> None:
    X = _sparse(50, 7, 0.3, 3, np.int32)
    freeze(X)  # as the row cache hands them out
    for kind in ("least_squares", "logistic", "softmax"):
        model, w, y = _problem(kind, 50, 7, 4, True, 3)
        np.testing.assert_allclose(model.loss_and_grad(w, X, y)[1], model.loss_and_grad(w, X.toarray(), y)[1])
        np.testing.assert_allclose(model.predict(w, X), model.predict(w, X.toarray()), rtol=1e-12)
        value, grad = models.objective(model, w, X, y, l2=0.1)
        dense_value, dense_grad = models.objective(model, w, X.toarray(), y, l2=0.1)
        assert value == pytest.approx(dense_value, rel=1e-12)
        np.testing.assert_allclose(grad, dense_grad, rtol=1e-12, atol=1e-14)


def test_bad_sparse_rows_are_refused_with_a_message() -> None:
    model = Logistic(4)
    w, y = np.zeros(5), np.array([0.0, 1.0])
    with pytest.raises(DatasetError, match=r"shape \(n_rows, 4\).*shape \(2, 3\)"):
        model.loss_and_grad(w, sp.csr_array(np.ones((2, 3))), y)
    with pytest.raises(DatasetError, match="labels y of shape"):
        model.loss_and_grad(w, sp.csr_array(np.ones((2, 4))), np.zeros(3))
    nan_rows = sp.csr_array(np.array([[1.0, 0, 0, 0], [0, np.nan, 0, 0]]))
    with pytest.raises(DatasetError, match="NaN or inf \\(first at row 1\\)"):
        model.loss_and_grad(w, nan_rows, y)


def test_out_of_range_indices_are_refused_before_the_unchecked_kernel_runs() -> None:
    for bad in (7, -1):
        X = sp.csr_array(
            (np.ones(2), np.array([0, bad], np.int32), np.array([0, 1, 2], np.int32)), shape=(2, 4)
        )
        with pytest.raises(DatasetError, match=r"column index outside 0..3.*malformed"):
            Logistic(4).loss_and_grad(np.zeros(5), X, np.array([0.0, 1.0]))


def test_mlp_refuses_sparse_rows_and_says_what_to_do() -> None:
    model = MLP([4, 3, 2])
    w = model.init_params(0)
    with pytest.raises(DatasetError, match=r"dense rows.*toarray\(\).*linear model"):
        model.loss_and_grad(w, sp.csr_array(np.eye(4)), np.array([0, 1, 0, 1]))
    with pytest.raises(DatasetError, match="dense rows"):
        model.predict(w, sp.csr_matrix(np.eye(4)))
