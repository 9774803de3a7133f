"""Gradients against central finite differences, stability, and sum-not-mean semantics."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray
from scipy.special import logsumexp

from distbelief.models import MLP, LeastSquares, Logistic, Softmax
from tests.models._helpers import assert_gradient_matches

FAST = settings(max_examples=25, deadline=None)

rows = st.integers(1, 12)
features = st.integers(1, 6)
classes = st.integers(2, 5)
seeds = st.integers(0, 2**32 - 1)
activations = st.sampled_from(["sigmoid", "tanh", "relu"])
hidden = st.lists(st.integers(1, 6), min_size=0, max_size=2)


def _data(seed: int, n: int, d: int, scale: float = 1.0) -> tuple[np.random.Generator, NDArray[np.float64]]:
    rng = np.random.default_rng(seed)
    return rng, rng.normal(scale=scale, size=(n, d))


@FAST
@given(n=rows, d=features, intercept=st.booleans(), seed=seeds)
def test_least_squares_gradient(n: int, d: int, intercept: bool, seed: int) -> None:
    rng, X = _data(seed, n, d)
    model = LeastSquares(d, fit_intercept=intercept)
    assert_gradient_matches(model, rng.normal(size=model.n_params), X, rng.normal(size=n))


@FAST
@given(n=rows, d=features, intercept=st.booleans(), seed=seeds, int_labels=st.booleans())
def test_logistic_gradient(n: int, d: int, intercept: bool, seed: int, int_labels: bool) -> None:
    rng, X = _data(seed, n, d)
    model = Logistic(d, fit_intercept=intercept)
    y = rng.integers(0, 2, size=n)
    assert_gradient_matches(model, rng.normal(size=model.n_params), X, y if int_labels else y.astype(float))


@FAST
@given(n=rows, d=features, k=classes, intercept=st.booleans(), seed=seeds, int_labels=st.booleans())
def test_softmax_gradient(n: int, d: int, k: int, intercept: bool, seed: int, int_labels: bool) -> None:
    rng, X = _data(seed, n, d)
    model = Softmax(d, k, fit_intercept=intercept)
    y = rng.integers(0, k, size=n)
    assert_gradient_matches(model, rng.normal(size=model.n_params), X, y if int_labels else y.astype(float))


def _preactivations(model: MLP, w: NDArray[np.float64], X: NDArray[np.float64]) -> list[NDArray[np.float64]]:
    """Hidden pre-activations, computed independently of the model's forward pass."""
    out = []
    A = X
    act: dict[str, Callable[[NDArray[np.float64]], NDArray[np.float64]]] = {
        "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
        "tanh": np.tanh,
        "relu": lambda z: np.maximum(z, 0),
    }
    for W, b in model.unpack(w)[:-1]:
        Z = A @ W + b
        out.append(Z)
        A = act[model.activation](Z)
    return out


@FAST
@given(n=rows, d=features, k=classes, sizes=hidden, activation=activations, seed=seeds)
def test_mlp_gradient(n: int, d: int, k: int, sizes: list[int], activation: str, seed: int) -> None:
    rng, X = _data(seed, n, d)
    model = MLP([d, *sizes, k], activation=activation)
    w = rng.normal(size=model.n_params)
    if activation == "relu":
        # Finite differences straddling a ReLU kink measure a one-sided slope, not the gradient.
        assume(all(np.abs(Z).min() > 1e-4 for Z in _preactivations(model, w, X)))
    assert_gradient_matches(model, w, X, rng.integers(0, k, size=n))


@pytest.mark.parametrize("activation", ["sigmoid", "tanh", "relu"])
def test_mlp_gradient_from_init_params(activation: str) -> None:
    # From the scaled initialization (not just random normal weights), on a deeper net.
    rng, X = _data(7, 9, 5)
    model = MLP([5, 7, 6, 4], activation=activation)
    assert_gradient_matches(model, model.init_params(seed=3), X, rng.integers(0, 4, size=9))


def _all_models() -> list[tuple[Any, NDArray[np.generic]]]:
    rng = np.random.default_rng(11)
    n = 20
    return [
        (LeastSquares(4), rng.normal(size=n)),
        (Logistic(4), rng.integers(0, 2, size=n).astype(float)),
        (Softmax(4, 3), rng.integers(0, 3, size=n)),
        (MLP([4, 5, 3], activation="sigmoid"), rng.integers(0, 3, size=n)),
        (MLP([4, 5, 3], activation="tanh"), rng.integers(0, 3, size=n)),
        (MLP([4, 5, 4, 3], activation="relu"), rng.integers(0, 3, size=n)),
    ]


@pytest.mark.parametrize(("model", "y"), _all_models(), ids=repr)
def test_loss_is_a_sum_over_rows(model: Any, y: NDArray[np.generic]) -> None:
    X = np.random.default_rng(2).normal(size=(len(y), 4))
    w = np.random.default_rng(3).normal(size=model.n_params)
    loss, grad = model.loss_and_grad(w, X, y)
    loss_a, grad_a = model.loss_and_grad(w, X[:7], y[:7])
    loss_b, grad_b = model.loss_and_grad(w, X[7:], y[7:])
    assert loss == pytest.approx(loss_a + loss_b, rel=1e-12)
    np.testing.assert_allclose(grad, grad_a + grad_b, rtol=1e-10, atol=1e-12)
    # Not a mean: duplicating every row doubles loss and gradient.
    loss_2, grad_2 = model.loss_and_grad(w, np.vstack([X, X]), np.concatenate([y, y]))
    assert loss_2 == pytest.approx(2 * loss, rel=1e-12)
    np.testing.assert_allclose(grad_2, 2 * grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("model", "y"), _all_models(), ids=repr)
def test_zero_rows_give_zero_loss_and_gradient(model: Any, y: NDArray[np.generic]) -> None:
    loss, grad = model.loss_and_grad(model.init_params(seed=0), np.empty((0, 4)), y[:0])
    assert loss == 0.0
    np.testing.assert_array_equal(grad, np.zeros(model.n_params))


@pytest.mark.parametrize(("model", "y"), _all_models(), ids=repr)
def test_inputs_are_not_modified_or_copied(model: Any, y: NDArray[np.generic]) -> None:
    rng = np.random.default_rng(5)
    n = 20_000  # X is 640 kB: a copy of it would dominate the peak below
    y_big = np.resize(y, n)
    X = rng.normal(size=(n, 4))
    X.flags.writeable = False
    w = rng.normal(size=model.n_params)
    w.flags.writeable = False
    X_before, y_before, w_before = X.copy(), y_big.copy(), w.copy()
    model.loss_and_grad(w, X, y_big)  # warm up, so lazy imports do not count
    tracemalloc.start()
    try:
        model.loss_and_grad(w, X, y_big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(X, X_before)
    np.testing.assert_array_equal(y_big, y_before)
    np.testing.assert_array_equal(w, w_before)
    # Per-row temporaries (a few vectors of n, or n x hidden) are fine; an n x d copy of X is not.
    per_row_floats = max(4, *(getattr(model, "layer_sizes", (0,))))
    assert peak < 8 * n * (per_row_floats * 3 + 8), peak


def test_no_copy_of_large_x_for_logistic() -> None:
    # The hot path of the whole system: temporaries must be O(n), never O(n * d).
    rng = np.random.default_rng(0)
    n, d = 4000, 200
    X = rng.normal(size=(n, d))
    y = rng.integers(0, 2, size=n).astype(float)
    model = Logistic(d)
    w = rng.normal(size=model.n_params) * 0.01
    model.loss_and_grad(w, X, y)
    tracemalloc.start()
    try:
        model.loss_and_grad(w, X, y)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < X.nbytes / 10, f"peak {peak} bytes for X of {X.nbytes} bytes"


# --- stability -------------------------------------------------------------------------------------------


def _stable_reference(model: Any, w: NDArray[np.float64], X: NDArray[np.float64], y: NDArray[Any]) -> float:
    """The loss computed independently, with scipy's logsumexp on explicit logits."""
    if isinstance(model, Logistic):
        z = X @ w[:-1] + w[-1]
        logits = np.stack([np.zeros_like(z), z], axis=1)
    elif isinstance(model, Softmax):
        W, b = model.unpack(w)
        assert b is not None
        logits = X @ W + b
    else:
        A = X
        layers = model.unpack(w)
        for W, b in layers[:-1]:
            A = np.tanh(A @ W + b)
        logits = A @ layers[-1][0] + layers[-1][1]
    labels = np.asarray(y, dtype=int)
    return float(np.sum(logsumexp(logits, axis=1) - logits[np.arange(len(labels)), labels]))


@pytest.mark.parametrize(
    ("model", "n_classes"),
    [(Logistic(3), 2), (Softmax(3, 4), 4), (MLP([3, 5, 4], activation="tanh"), 4)],
    ids=repr,
)
def test_huge_logits_give_finite_exact_loss(model: Any, n_classes: int) -> None:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(30, 3))
    y = rng.integers(0, n_classes, size=30)
    w = rng.normal(size=model.n_params) * 1e4  # logits of order 1e4..1e5: exp() overflows naively
    loss, grad = model.loss_and_grad(w, X, y)
    assert np.isfinite(loss) and loss > 1e3
    assert np.isfinite(grad).all()
    assert loss == pytest.approx(_stable_reference(model, w, X, y), rel=1e-12)


@pytest.mark.parametrize(
    "model",
    [
        LeastSquares(3),
        Logistic(3),
        Softmax(3, 4),
        MLP([3, 6, 4], activation="sigmoid"),
        MLP([3, 6, 4], activation="relu"),
        MLP([3, 6, 5, 4], activation="tanh"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("scale", [1e4, -1e4])
def test_huge_parameters_keep_loss_and_gradient_finite(model: Any, scale: float) -> None:
    rng = np.random.default_rng(4)
    X = rng.normal(size=(25, 3))
    y = rng.integers(0, 2, size=25).astype(float)
    w = rng.normal(size=model.n_params) * scale
    loss, grad = model.loss_and_grad(w, X, y)
    assert np.isfinite(loss) and loss >= 0
    assert np.isfinite(grad).all()


def test_logistic_confident_correct_predictions_cost_almost_nothing() -> None:
    # Margin form: loss_i = log(1 + exp(-margin)) is tiny and positive, not 0 - 0 cancellation noise.
    model = Logistic(1, fit_intercept=False)
    loss, grad = model.loss_and_grad(np.array([30.0]), np.array([[1.0], [-1.0]]), np.array([1, 0]))
    assert loss == pytest.approx(2 * np.log1p(np.exp(-30.0)), rel=1e-12, abs=0)
    assert grad[0] == pytest.approx(-2 * np.exp(-30.0) / (1 + np.exp(-30.0)), rel=1e-6)


def test_softmax_confident_correct_predictions_keep_their_precision() -> None:
    # log1p of the non-largest exponentials, and p_y - 1 formed as -sum of the other probabilities.
    model = Softmax(1, 2, fit_intercept=False)
    w = np.array([-15.0, 15.0])  # logit difference 30 * x
    loss, grad = model.loss_and_grad(w, np.array([[1.0], [-1.0]]), np.array([1, 0]))
    p_wrong = np.exp(-30.0) / (1 + np.exp(-30.0))
    assert loss == pytest.approx(2 * np.log1p(np.exp(-30.0)), rel=1e-12, abs=0)
    np.testing.assert_allclose(grad, [2 * p_wrong, -2 * p_wrong], rtol=1e-12)
