"""``loss_and_grad(..., sample_weight=s)`` of the built-in models: ``sum_i s_i loss_i`` and its gradient."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp

from distbelief import models
from distbelief.errors import DatasetError

RNG = np.random.default_rng(0)
X = RNG.normal(size=(60, 4))
S = RNG.uniform(0.0, 3.0, 60)
S[::7] = 0.0

CASES: list[tuple[Any, np.ndarray]] = [
    (models.LeastSquares(4), RNG.normal(size=60)),
    (models.LeastSquares(4, fit_intercept=False), RNG.normal(size=60)),
    (models.Logistic(4), RNG.integers(0, 2, 60).astype(float)),
    (models.Softmax(4, 3), RNG.integers(0, 3, 60).astype(float)),
    (models.Softmax(4, 3, fit_intercept=False), RNG.integers(0, 3, 60).astype(float)),
    (models.MLP([4, 5, 3], activation="tanh"), RNG.integers(0, 3, 60).astype(float)),
]


@pytest.mark.parametrize(("model", "y"), CASES, ids=lambda c: repr(c)[:40])
def test_weighted_is_the_weighted_sum_of_single_rows(model: Any, y: np.ndarray) -> None:
    w = RNG.normal(size=model.n_params)
    loss, grad = model.loss_and_grad(w, X, y, sample_weight=S)
    rows = [model.loss_and_grad(w, X[i : i + 1], y[i : i + 1]) for i in range(len(y))]
    assert loss == pytest.approx(sum(s * r[0] for s, r in zip(S, rows, strict=True)), rel=1e-12)
    np.testing.assert_allclose(grad, sum(s * r[1] for s, r in zip(S, rows, strict=True)), atol=1e-12)
    ones = model.loss_and_grad(w, X, y, sample_weight=np.ones(len(y)))
    plain = model.loss_and_grad(w, X, y)
    assert ones[0] == pytest.approx(plain[0], rel=1e-12)
    np.testing.assert_allclose(ones[1], plain[1], atol=1e-12)


@pytest.mark.parametrize(("model", "y"), CASES[:5], ids=lambda c: repr(c)[:40])
def test_weighted_sparse_rows_equal_dense(model: Any, y: np.ndarray) -> None:
    w = RNG.normal(size=model.n_params)
    dense = model.loss_and_grad(w, X, y, sample_weight=S)
    sparse = model.loss_and_grad(w, sp.csr_array(X), y, sample_weight=S)
    assert sparse[0] == pytest.approx(dense[0], rel=1e-12)
    np.testing.assert_allclose(sparse[1], dense[1], atol=1e-12)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (np.ones(3), r"sample_weight of shape \(60,\)"),
        (-S, "finite sample weights >= 0"),
        (S * np.nan, "finite"),
    ],
)
def test_bad_weights_say_what_to_do(weights: np.ndarray, message: str) -> None:
    model, y = CASES[2]
    with pytest.raises(DatasetError, match=message):
        model.loss_and_grad(np.zeros(model.n_params), X, y, sample_weight=weights)
