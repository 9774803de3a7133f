"""Models against independent oracles (numpy lstsq, scikit-learn's log_loss, scipy fits), predictions,
labels, bad input, the Model protocol and the reference objective."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import scipy.optimize
from numpy.typing import NDArray
from sklearn.metrics import log_loss

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.models import MLP, LeastSquares, LocallyConnected, Logistic, Model, Softmax, objective
from tests.models._helpers import assert_gradient_matches

FloatArray = NDArray[np.float64]


def _fit(model: Any, X: FloatArray, y: Any, *, l2: float, w0: FloatArray | None = None) -> FloatArray:
    """Minimize models.objective with scipy's L-BFGS-B to a tight tolerance.

    What the oracle comparisons need is a stationary point, so that is what is checked where ``success``
    is not: at these tolerances L-BFGS-B's line search ends ``ABNORMAL`` once it cannot decrease ``F`` within
    rounding, at the same point, on some BLAS kernels (OPENBLAS_CORETYPE=Haswell) and not on others.
    """
    start = model.init_params(seed=0) if w0 is None else w0
    result = scipy.optimize.minimize(
        lambda w: objective(model, w, X, y, l2=l2),
        start,
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 5000, "gtol": 1e-10, "ftol": 1e-15},
    )
    if not result.success:  # only an ABNORMAL line search at a stationary point is taken
        assert result.status == 2 and np.max(np.abs(result.jac)) < 1e-7, result.message
    return np.asarray(result.x)


# --- values against independent oracles ------------------------------------------------------------------


def test_least_squares_fit_matches_lstsq() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 4))
    y = X @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.7 + 0.1 * rng.normal(size=60)
    model = LeastSquares(4)
    w = _fit(model, X, y, l2=0.0)
    expected, *_ = np.linalg.lstsq(np.hstack([X, np.ones((60, 1))]), y, rcond=None)
    np.testing.assert_allclose(w, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(model.predict(w, X), np.hstack([X, np.ones((60, 1))]) @ expected, atol=1e-6)
    loss, _ = model.loss_and_grad(w, X, y)
    assert loss == pytest.approx(0.5 * np.sum((X @ w[:4] + w[4] - y) ** 2), rel=1e-12)


def test_logistic_and_softmax_losses_match_sklearn_log_loss() -> None:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 3))
    y2 = rng.integers(0, 2, size=40)
    logistic = Logistic(3)
    w = rng.normal(size=4)
    p1 = logistic.predict_proba(w, X)
    assert logistic.loss_and_grad(w, X, y2)[0] == pytest.approx(log_loss(y2, p1, normalize=False), rel=1e-10)
    y4 = rng.integers(0, 4, size=40)
    for model in (Softmax(3, 4), MLP([3, 5, 4], activation="tanh")):
        w = rng.normal(size=model.n_params)
        proba = model.predict_proba(w, X)
        np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-12)
        expected = log_loss(y4, proba, normalize=False, labels=range(4))
        assert model.loss_and_grad(w, X, y4)[0] == pytest.approx(expected, rel=1e-10)


def test_mlp_without_hidden_layers_is_softmax_regression() -> None:
    rng = np.random.default_rng(2)
    X, y = rng.normal(size=(15, 3)), rng.integers(0, 4, size=15)
    w = rng.normal(size=16)
    loss_s, grad_s = Softmax(3, 4).loss_and_grad(w, X, y)
    loss_m, grad_m = MLP([3, 4]).loss_and_grad(w, X, y)
    assert loss_m == pytest.approx(loss_s, rel=1e-13)
    np.testing.assert_allclose(grad_m, grad_s, rtol=1e-12, atol=1e-14)


def test_softmax_with_two_classes_agrees_with_logistic_after_fitting() -> None:
    # With weights (v0, v1), softmax depends on u = v1 - v0 only, and at the l2-regularized optimum
    # v0 = -v1 (the class gradients sum to zero), so (l2/2)(|v0|^2 + |v1|^2) = (l2/4)|u|^2: softmax with
    # strength l2 is logistic regression on u with strength l2/2. scipy fits both independently.
    rng = np.random.default_rng(3)
    n, d = 200, 5
    X = rng.normal(size=(n, d))
    y = (X @ rng.normal(size=d) + 0.3 + rng.normal(size=n) > 0).astype(float)  # overlapping classes
    l2 = 0.02
    softmax, logistic = Softmax(d, 2), Logistic(d)
    w_s = _fit(softmax, X, y, l2=l2)
    w_l = _fit(logistic, X, y, l2=l2 / 2)
    W, b = softmax.unpack(w_s)
    assert b is not None
    np.testing.assert_allclose(W[:, 1] - W[:, 0], w_l[:d], rtol=1e-5, atol=1e-6)
    assert b[1] - b[0] == pytest.approx(w_l[d], rel=1e-5, abs=1e-6)
    p_soft = softmax.predict_proba(w_s, X)[:, 1]
    p_log = logistic.predict_proba(w_l, X)
    np.testing.assert_allclose(p_soft, p_log, atol=1e-6)
    clear = np.abs(p_log - 0.5) > 1e-4  # leave out rows a rounding error could flip
    np.testing.assert_array_equal(softmax.predict(w_s, X)[clear], logistic.predict(w_l, X)[clear])
    assert softmax.accuracy(w_s, X, y) == pytest.approx(logistic.accuracy(w_l, X, y), abs=1 / n)
    assert 0.7 < logistic.accuracy(w_l, X, y) < 1.0  # a real, imperfect fit


# --- predictions on separable toy problems ---------------------------------------------------------------


def test_logistic_separates_a_separable_problem() -> None:
    rng = np.random.default_rng(4)
    X = rng.normal(size=(100, 2))
    X[:, 0] += np.where(np.arange(100) < 50, -3.0, 3.0)
    y = (np.arange(100) >= 50).astype(float)
    model = Logistic(2)
    w0 = model.init_params()
    assert model.accuracy(w0, X, y) == 0.5  # all-zero parameters predict class 0 everywhere
    w = _fit(model, X, y, l2=1e-3)
    assert model.accuracy(w, X, y) == 1.0
    np.testing.assert_array_equal(model.predict(w, X), y.astype(np.int64))
    proba = model.predict_proba(w, X)
    assert proba.shape == (100,) and ((proba > 0.5) == (y == 1)).all()


def test_softmax_separates_three_clusters() -> None:
    rng = np.random.default_rng(5)
    centers = np.array([[0.0, 5.0], [-5.0, -3.0], [5.0, -3.0]])
    y = np.repeat(np.arange(3), 40)
    X = centers[y] + rng.normal(size=(120, 2))
    model = Softmax(2, 3)
    w = _fit(model, X, y.astype(float), l2=1e-3)
    assert model.accuracy(w, X, y) == 1.0
    labels = model.predict(w, X)
    assert labels.dtype == np.int64
    np.testing.assert_array_equal(labels, y)
    assert model.accuracy(w, X, (y + 1) % 3) == 0.0


@pytest.mark.parametrize("activation", ["sigmoid", "tanh", "relu"])
def test_mlp_learns_xor_which_no_linear_model_can(activation: str) -> None:
    rng = np.random.default_rng(6)
    signs = np.repeat([[-1.0, -1.0], [-1.0, 1.0], [1.0, -1.0], [1.0, 1.0]], 50, axis=0)  # a line gets <= 3/4
    X = signs + 0.15 * rng.normal(size=(200, 2))
    y = (signs[:, 0] != signs[:, 1]).astype(np.int64)
    mlp = MLP([2, 8, 2], activation=activation)
    w = _fit(mlp, X, y, l2=1e-4, w0=mlp.init_params(seed=1))
    assert mlp.accuracy(w, X, y) == 1.0
    linear = Softmax(2, 2)
    assert linear.accuracy(_fit(linear, X, y, l2=1e-4), X, y) < 0.8


# --- labels and bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "good", "bad", "fragment"),
    [
        (LeastSquares(2), [0.5, -3.0, 1e300], [1.0, np.nan], "finite"),
        (LeastSquares(2), [0.5], [np.inf], "row 0"),
        (Logistic(2), [0, 1, 1], [0, 2, 1], "0 or 1"),
        (Logistic(2), [True, False], [-1, 0], "0 or 1"),
        (Logistic(2), [0.0, 1.0], [0.5, 1.0], "0.5"),
        (Logistic(2), [0.0, 1.0], [np.nan, 1.0], "0 or 1"),
        (Logistic(2), [0.0, 1.0], [np.inf, 1.0], "0 or 1"),
        (Softmax(2, 3), [0, 1, 2], [0, 3], "0..2"),
        (Softmax(2, 3), [0.0, 2.0], [-1.0, 1.0], "0..2"),
        (Softmax(2, 3), np.array([0, 2], dtype=np.uint8), [1.5, 1.0], "1.5"),
        (Softmax(2, 3), [1.0, 2.0], [np.nan, 1.0], "0..2"),
        (Softmax(2, 3), [1.0, 2.0], [1.0, np.inf], "row 1"),
        (MLP([2, 3, 4]), [3, 0], [4, 0], "0..3"),
    ],
)
def test_check_labels(model: Any, good: Any, bad: Any, fragment: str) -> None:
    model.check_labels(np.asarray(good))
    with pytest.raises(DatasetError, match="expects") as info:
        model.check_labels(np.asarray(bad))
    assert fragment in str(info.value)
    if model.label_kind != "real":  # training on bad labels fails the same way
        X = np.ones((len(bad), 2))
        with pytest.raises(DatasetError, match="expects"):
            model.loss_and_grad(model.init_params(seed=0), X, np.asarray(bad))
        with pytest.raises(DatasetError, match="expects"):
            model.accuracy(model.init_params(seed=0), X, np.asarray(bad))


def test_check_labels_rejects_wrong_shapes_and_types() -> None:
    with pytest.raises(DatasetError, match="1-D"):
        Logistic(2).check_labels(np.zeros((3, 1)))
    with pytest.raises(DatasetError, match="numeric"):
        Softmax(2, 3).check_labels(np.array(["a", "b"]))


@pytest.mark.parametrize(
    "model", [LeastSquares(3), Logistic(3), Softmax(3, 2), MLP([3, 4, 2], activation="relu")], ids=repr
)
def test_bad_shapes_raise_errors_that_say_what_to_pass(model: Any) -> None:
    w = model.init_params(seed=0)
    X = np.ones((4, 3))
    y = np.zeros(4)
    with pytest.raises(InvalidOptionError, match=rf"shape \({model.n_params},\)"):
        model.loss_and_grad(w[:-1], X, y)
    with pytest.raises(DatasetError, match=r"\(n_rows, 3\)"):
        model.loss_and_grad(w, np.ones((4, 2)), y)
    with pytest.raises(DatasetError, match=r"\(n_rows, 3\)"):
        model.loss_and_grad(w, np.ones(3), y)
    with pytest.raises(DatasetError, match=r"shape \(4,\)"):
        model.loss_and_grad(w, X, np.zeros(5))
    with pytest.raises(DatasetError, match=r"shape \(4,\)"):
        model.loss_and_grad(w, X, np.zeros((4, 1)))
    with pytest.raises(InvalidOptionError):
        model.predict(w[:-1], X)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy's, before our clearer error
@pytest.mark.parametrize(
    "model", [LeastSquares(3), Logistic(3), Softmax(3, 2), MLP([3, 4, 2], activation="tanh")], ids=repr
)
def test_non_finite_values_are_diagnosed(model: Any) -> None:
    rng = np.random.default_rng(8)
    X, y, w = rng.normal(size=(6, 3)), np.array([0, 1, 1, 0, 1, 0.0]), model.init_params(seed=0)
    X_bad = X.copy()
    X_bad[4, 1] = np.nan
    with pytest.raises(DatasetError, match="row 4"):
        model.loss_and_grad(w, X_bad, y)
    w_bad = w.copy()
    w_bad[0] = np.inf
    with pytest.raises(InvalidOptionError, match="diverged"):
        model.loss_and_grad(w_bad, X, y)
    if isinstance(model, LeastSquares):
        y_bad = y.copy()
        y_bad[2] = np.nan
        with pytest.raises(DatasetError, match="row 2"):
            model.loss_and_grad(w, X, y_bad)


def test_least_squares_overflow_is_returned_not_misreported() -> None:
    # A genuinely huge residual is a valid (infinite) loss for a line search to back off from.
    model = LeastSquares(1, fit_intercept=False)
    with np.errstate(over="ignore"):
        loss, _ = model.loss_and_grad(np.array([1e200]), np.array([[1e200]]), np.array([0.0]))
    assert loss == np.inf


def test_accuracy_of_zero_rows_is_an_error() -> None:
    with pytest.raises(DatasetError, match="zero rows"):
        Logistic(2).accuracy(np.zeros(3), np.empty((0, 2)), np.empty(0))


def test_only_classifiers_have_accuracy() -> None:
    # Downpour reports test_accuracy NaN for a model without ``accuracy``: a regressor must not get one.
    assert not hasattr(LeastSquares(2), "accuracy")
    assert all(
        hasattr(m, "accuracy")
        for m in (Logistic(2), Softmax(2, 3), MLP([2, 3]), LocallyConnected(4, 2, fields=[2], strides=[2]))
    )


def test_predictions_have_the_documented_shapes_and_types() -> None:
    X = np.random.default_rng(9).normal(size=(7, 3))
    assert LeastSquares(3).predict(np.ones(4), X).shape == (7,)
    assert Logistic(3).predict(np.ones(4), X).dtype == np.int64
    assert set(Logistic(3).predict(np.ones(4), X)) <= {0, 1}
    assert Softmax(3, 4).predict_proba(np.ones(16), X).shape == (7, 4)
    mlp = MLP([3, 5, 4])
    assert mlp.predict(mlp.init_params(seed=0), X).shape == (7,)
    assert mlp.predict_proba(mlp.init_params(seed=0), X).shape == (7, 4)


# --- initialization --------------------------------------------------------------------------------------


def test_linear_models_start_at_zero() -> None:
    for model in (LeastSquares(3), Logistic(3), Softmax(3, 4)):
        np.testing.assert_array_equal(model.init_params(seed=5), np.zeros(model.n_params))


@pytest.mark.parametrize("activation", ["sigmoid", "tanh", "relu"])
def test_mlp_init_is_seeded_and_scaled(activation: str) -> None:
    model = MLP([300, 200, 10], activation=activation)
    w = model.init_params(seed=1)
    np.testing.assert_array_equal(w, model.init_params(seed=1))
    assert not np.array_equal(w, model.init_params(seed=2))
    (W1, b1), (W2, b2) = model.unpack(w)
    assert not b1.any() and not b2.any()
    glorot_out = np.sqrt(6 / (200 + 10))
    assert np.abs(W2).max() <= glorot_out and W2.std() == pytest.approx(glorot_out / np.sqrt(3), rel=0.05)
    if activation == "relu":  # He normal
        assert W1.std() == pytest.approx(np.sqrt(2 / 300), rel=0.02)
    else:  # Glorot uniform
        limit = np.sqrt(6 / (300 + 200))
        assert np.abs(W1).max() <= limit and W1.std() == pytest.approx(limit / np.sqrt(3), rel=0.02)


def test_mlp_layout_is_layer_by_layer_weights_then_biases() -> None:
    model = MLP([2, 3, 2])
    w = np.arange(model.n_params, dtype=float)
    (W1, b1), (W2, b2) = model.unpack(w)
    np.testing.assert_array_equal(W1, np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(b1, [6.0, 7.0, 8.0])
    np.testing.assert_array_equal(W2, np.arange(9.0, 15.0).reshape(3, 2))
    np.testing.assert_array_equal(b2, [15.0, 16.0])
    W1[0, 0] = -1.0  # views, not copies
    assert w[0] == -1.0


# --- the protocol and the reference objective ------------------------------------------------------------


class _Quadratic:
    """A user-defined model: loss_i = 0.5 * ||w - x_i||^2 (the mean of the rows minimizes it)."""

    n_params = 2

    def init_params(self, seed: int | None = None) -> FloatArray:
        return np.zeros(2)

    def loss_and_grad(self, w: Any, X: Any, y: Any) -> tuple[float, FloatArray]:
        diff = np.asarray(w) - np.asarray(X)
        return 0.5 * float(np.sum(diff**2)), diff.sum(axis=0)


def test_model_protocol_is_structural() -> None:
    for model in (LeastSquares(2), Logistic(2), Softmax(2, 3), MLP([2, 2])):
        assert isinstance(model, Model)
    assert isinstance(_Quadratic(), Model)
    assert not isinstance(object(), Model)


def test_objective_with_a_user_model_is_minimized_at_the_mean() -> None:
    X = np.array([[1.0, 2.0], [3.0, 6.0]])
    model = _Quadratic()
    assert_gradient_matches(model, np.array([0.3, -0.2]), X, np.zeros(2))
    value, grad = objective(model, np.array([2.0, 4.0]), X, np.zeros(2))
    assert value == pytest.approx(0.5 * (1 + 4 + 1 + 4) / 2)
    np.testing.assert_allclose(grad, [0.0, 0.0])


def test_objective_definition_and_n_total() -> None:
    rng = np.random.default_rng(10)
    X, y = rng.normal(size=(30, 3)), rng.integers(0, 2, size=30)
    model = Logistic(3)
    w = rng.normal(size=4)
    loss, grad = model.loss_and_grad(w, X, y)
    value, g = objective(model, w, X, y, l2=0.3)
    assert value == pytest.approx(loss / 30 + 0.15 * w @ w, rel=1e-13)
    np.testing.assert_allclose(g, grad / 30 + 0.3 * w, rtol=1e-13)
    # Portions: the data terms of the parts with n_total = N add up to the full data term.
    v1, g1 = objective(model, w, X[:12], y[:12], n_total=30)
    v2, g2 = objective(model, w, X[12:], y[12:], n_total=30)
    v_all, g_all = objective(model, w, X, y)
    assert v1 + v2 == pytest.approx(v_all, rel=1e-13)
    np.testing.assert_allclose(g1 + g2, g_all, rtol=1e-12)
    v0, g0 = objective(model, w, np.empty((0, 3)), np.empty(0), n_total=30)
    assert v0 == 0.0
    np.testing.assert_array_equal(g0, np.zeros(4))


def test_objective_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(11)
    X, y = rng.normal(size=(10, 3)), rng.integers(0, 3, size=10)
    model = MLP([3, 4, 3], activation="tanh")
    w = model.init_params(seed=0)

    class _Objective:
        n_params = model.n_params

        def init_params(self, seed: int | None = None) -> FloatArray:
            return w

        def loss_and_grad(self, w: Any, X: Any, y: Any) -> tuple[float, FloatArray]:
            return objective(model, w, X, y, l2=0.5, n_total=7)

    assert_gradient_matches(_Objective(), w, X, y)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"l2": -1.0}, "l2"),
        ({"l2": float("nan")}, "l2"),
        ({"l2": float("inf")}, "l2"),
        ({"n_total": 0}, "n_total"),
        ({"n_total": 2.5}, "n_total"),
        ({"n_total": True}, "n_total"),
    ],
)
def test_objective_rejects_bad_options(options: dict[str, Any], fragment: str) -> None:
    model = Logistic(2)
    with pytest.raises(InvalidOptionError, match=fragment):
        objective(model, np.zeros(3), np.ones((2, 2)), np.array([0, 1]), **options)


def test_objective_of_zero_rows_needs_n_total() -> None:
    with pytest.raises(InvalidOptionError, match="n_total"):
        objective(Logistic(2), np.zeros(3), np.empty((0, 2)), np.empty(0))
