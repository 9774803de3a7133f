"""sample_weight, class_weight, warm_start, random_state and predict_log_proba against scikit-learn.

Each weighted fit is compared with scikit-learn's on the same data by scikit-learn's own objective,
``C * sum_i s_i loss_i + 0.5 ||coef||^2`` (``sum_i s_i r_i^2 + alpha ||coef||^2`` for Ridge), evaluated at
both solutions: ours must be within 1e-6 (relative) of scikit-learn's, and the coefficients close.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
import sklearn.linear_model as sk
from distributed import Client
from sklearn.datasets import load_breast_cancer, load_iris
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import log_loss
from sklearn.preprocessing import StandardScaler

from distbelief import models
from distbelief.errors import InvalidOptionError
from distbelief.sklearn import (
    LinearRegression,
    LogisticRegression,
    MLPClassifier,
    ModelClassifier,
    SoftmaxRegression,
)
from distbelief.sklearn._base import RowWeights, row_weights, with_weights
from distbelief.storage import Dataset

#: Our objective at our solution against scikit-learn's at its own (relative).
OBJECTIVE_RTOL = 1e-6


@pytest.fixture(scope="module")
def cancer() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y


@pytest.fixture(scope="module")
def iris() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_iris(return_X_y=True)
    return StandardScaler().fit_transform(X), y


def _weights(n: int, seed: int = 0) -> np.ndarray:
    """Weights in [0, 3) with a few exact zeros (rows that must not count)."""
    s = np.random.default_rng(seed).uniform(0.0, 3.0, n)
    s[::17] = 0.0
    return s


def _logistic_objective(est: Any, X: np.ndarray, y: np.ndarray, C: float, s: np.ndarray | None) -> float:
    """scikit-learn's LogisticRegression objective (l2) at ``est``'s coefficients, with its class weights."""
    index = np.searchsorted(est.classes_, y).astype(np.float64)
    weights = row_weights(s, est.class_weight, est.classes_, index, "t")
    data = log_loss(y, est.predict_proba(X), sample_weight=weights, normalize=False, labels=est.classes_)
    coef = np.asarray(est.coef_)
    return float(C * data + 0.5 * np.sum(coef * coef))


def _assert_same_fit(ours: Any, ref: Any, value: Any) -> None:
    f_ours, f_ref = value(ours), value(ref)
    assert f_ours <= f_ref * (1 + OBJECTIVE_RTOL), (f_ours, f_ref)
    assert abs(f_ours - f_ref) <= OBJECTIVE_RTOL * abs(f_ref), (f_ours, f_ref)


@pytest.mark.parametrize("class_weight", [None, "balanced", {0: 3.0}])
def test_binary_sample_and_class_weight_match_sklearn(
    cancer: tuple[np.ndarray, np.ndarray], class_weight: Any
) -> None:
    X, y = cancer
    s, C = _weights(len(y)), 0.5
    ours = LogisticRegression(C=C, tol=1e-10, max_iter=1000, class_weight=class_weight)
    ours.fit(X, y, sample_weight=s)
    ref = sk.LogisticRegression(C=C, tol=1e-12, max_iter=10_000, class_weight=class_weight)
    ref.fit(X, y, sample_weight=s)
    _assert_same_fit(ours, ref, lambda e: _logistic_objective(e, X, y, C, s))
    assert np.abs(ours.coef_ - ref.coef_).max() < 1e-5
    np.testing.assert_allclose(ours.predict_proba(X), ref.predict_proba(X), atol=1e-6)


@pytest.mark.parametrize("est", [LogisticRegression, SoftmaxRegression])
@pytest.mark.parametrize("class_weight", ["balanced", {0: 2.0, 2: 0.5}])
def test_multiclass_weights_match_sklearn(
    iris: tuple[np.ndarray, np.ndarray], est: type, class_weight: Any
) -> None:
    X, y = iris
    s, C = _weights(len(y), seed=1), 2.0
    ours = est(C=C, tol=1e-10, max_iter=2000, class_weight=class_weight).fit(X, y, sample_weight=s)
    ref = sk.LogisticRegression(C=C, tol=1e-12, max_iter=10_000, class_weight=class_weight)
    ref.fit(X, y, sample_weight=s)
    _assert_same_fit(ours, ref, lambda e: _logistic_objective(e, X, y, C, s))
    np.testing.assert_allclose(ours.predict_proba(X), ref.predict_proba(X), atol=1e-5)


def test_class_weight_labels_are_the_original_ones(iris: tuple[np.ndarray, np.ndarray]) -> None:
    """class_weight's keys are y's labels (strings here), not the encoded 0..K-1."""
    X, y = iris
    names = np.array(["setosa", "versicolor", "virginica"])[y]
    cw = {"setosa": 4.0, "virginica": 0.25}
    ours = LogisticRegression(C=1.0, tol=1e-10, class_weight=cw).fit(X, names)
    ref = sk.LogisticRegression(C=1.0, tol=1e-12, max_iter=10_000, class_weight=cw).fit(X, names)
    _assert_same_fit(ours, ref, lambda e: _logistic_objective(e, X, names, 1.0, None))


@pytest.mark.parametrize("alpha", [0.0, 3.0])
def test_linear_regression_sample_weight_matches_sklearn(
    cancer: tuple[np.ndarray, np.ndarray], alpha: float
) -> None:
    X, _ = cancer
    rng = np.random.default_rng(2)
    y = X[:, :5] @ rng.normal(size=5) + 0.5 + rng.normal(size=len(X))
    s = _weights(len(y), seed=3)
    ours = LinearRegression(alpha=alpha, tol=1e-12, max_iter=5000).fit(X, y, sample_weight=s)
    ref = (sk.Ridge(alpha=alpha, solver="cholesky") if alpha else sk.LinearRegression()).fit(
        X, y, sample_weight=s
    )

    def value(e: Any) -> float:
        r = y - e.predict(X)
        return float(s @ (r * r) + alpha * e.coef_ @ e.coef_)

    _assert_same_fit(ours, ref, value)
    np.testing.assert_allclose(ours.predict(X), ref.predict(X), atol=1e-4)


def test_integer_weights_are_repeated_rows(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    counts = np.random.default_rng(4).integers(0, 3, len(y))
    weighted = LogisticRegression(C=0.3, tol=1e-10).fit(X, y, sample_weight=counts)
    repeated = LogisticRegression(C=0.3, tol=1e-10).fit(np.repeat(X, counts, 0), np.repeat(y, counts))
    assert np.abs(weighted.coef_ - repeated.coef_).max() < 1e-6


def test_sparse_rows_take_weights(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    """Weighted CSR rows (fitted with dense communication) give the dense weighted fit."""
    X, y = cancer
    s = _weights(len(y), seed=5)
    dense = LogisticRegression(C=0.5, tol=1e-10).fit(X, y, sample_weight=s)
    sparse = LogisticRegression(C=0.5, tol=1e-10).fit(sp.csr_array(X), y, sample_weight=s)
    assert np.abs(dense.coef_ - sparse.coef_).max() < 1e-6


def test_mlp_integer_weights_are_repeated_rows(iris: tuple[np.ndarray, np.ndarray]) -> None:
    """The MLP's loss weighs its rows (nonconvex: compared with repeating the rows, from the same start)."""
    X, y = iris
    counts = np.random.default_rng(6).integers(1, 3, len(y))
    opts: dict[str, Any] = dict(hidden_layer_sizes=(5,), random_state=0, max_iter=40, tol=0.0, alpha=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        weighted = MLPClassifier(**opts).fit(X, y, sample_weight=counts)
        repeated = MLPClassifier(**opts).fit(np.repeat(X, counts, 0), np.repeat(y, counts))
    np.testing.assert_allclose(weighted.predict_proba(X), repeated.predict_proba(X), atol=1e-6)


def test_scalar_weight_is_every_rows(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    """A number is every row's weight: 2 everywhere is C doubled, as in scikit-learn."""
    X, y = cancer
    doubled = LogisticRegression(C=0.25, tol=1e-10).fit(X, y, sample_weight=2.0)
    ref = sk.LogisticRegression(C=0.5, tol=1e-12, max_iter=10_000).fit(X, y)
    assert np.abs(doubled.coef_ - ref.coef_).max() < 1e-5


def test_row_weights_wrapper_sums_over_any_split() -> None:
    rng = np.random.default_rng(7)
    X, y, s = rng.normal(size=(40, 3)), rng.integers(0, 2, 40), rng.uniform(0, 2, 40)
    model, w = RowWeights(models.Logistic(3)), rng.normal(size=4)
    rows = with_weights(X, s)
    whole = model.loss_and_grad(w, rows, y)
    parts = [model.loss_and_grad(w, rows[a:b], y[a:b]) for a, b in ((0, 13), (13, 40))]
    assert whole[0] == pytest.approx(parts[0][0] + parts[1][0], rel=1e-12)
    np.testing.assert_allclose(whole[1], parts[0][1] + parts[1][1], atol=1e-12)
    assert model.n_features == 4 and model.spec is None


# ------------------------------------------------------------------------------------------ warm start


def test_warm_start_continues_to_sklearns_optimum(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    est = LogisticRegression(C=0.5, max_iter=3, tol=1e-10)
    with pytest.warns(ConvergenceWarning):
        est.fit(X, y)
    first = est.coef_.copy()
    ref = sk.LogisticRegression(C=0.5, tol=1e-12, max_iter=10_000).fit(X, y)
    starts: list[float] = []
    est.set_params(warm_start=True, max_iter=1000, callback=lambda r: starts.append(r.objective))
    est.fit(X, y)
    _assert_same_fit(est, ref, lambda e: _logistic_objective(e, X, y, 0.5, None))
    # It started where the first fit stopped: its first iterate is no worse than that point.
    cold = LogisticRegression(C=0.5, max_iter=1, tol=1e-10, callback=lambda r: starts.append(r.objective))
    with pytest.warns(ConvergenceWarning):
        cold.fit(X, y)
    assert starts[0] < starts[-1]
    assert not np.allclose(first, est.coef_)
    # A converged fit started again stops at once.
    assert est.fit(X, y).n_iter_[0] <= 2


def test_warm_start_mlp_starts_from_its_weights(iris: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = iris
    est = MLPClassifier(hidden_layer_sizes=(4,), random_state=0, max_iter=10, warm_start=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        est.fit(X, y)
        before = float(est.result_.fun)
        seen: list[float] = []
        est.set_params(callback=lambda r: seen.append(r.objective)).fit(X, y)
    assert seen[0] <= before


def test_warm_start_with_other_classes_says_what_to_do(iris: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = iris
    est = LogisticRegression(warm_start=True).fit(X, y)
    with pytest.raises(InvalidOptionError, match="warm_start=False"):
        est.fit(X, (y > 0).astype(int))
    with pytest.raises(InvalidOptionError, match="warm_start must be True or False"):
        LogisticRegression(warm_start="yes").fit(X, y)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ random_state


def test_random_state_seeds_the_mlp(iris: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = iris
    opts: dict[str, Any] = dict(hidden_layer_sizes=(4,), max_iter=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        a = MLPClassifier(random_state=1, **opts).fit(X, y)
        b = MLPClassifier(random_state=np.random.RandomState(1), **opts).fit(X, y)
        c = MLPClassifier(random_state=2, **opts).fit(X, y)
        again = MLPClassifier(random_state=1, **opts).fit(X, y)
    assert np.array_equal(a.coefs_[0], again.coefs_[0])
    assert b.coefs_[0].shape == a.coefs_[0].shape
    assert not np.array_equal(a.coefs_[0], c.coefs_[0])


@pytest.mark.parametrize("est", [LogisticRegression, LinearRegression, MLPClassifier])
@pytest.mark.parametrize("bad", [-1, 1.5, "seed", True])
def test_bad_random_state_says_what_to_pass(
    cancer: tuple[np.ndarray, np.ndarray], est: type, bad: Any
) -> None:
    X, y = cancer
    with pytest.raises(InvalidOptionError, match="random_state must be None, an int >= 0 or a numpy"):
        est(random_state=bad).fit(X[:50], y[:50])


# ------------------------------------------------------------------------------------ predict_log_proba


def test_predict_log_proba_matches_sklearn(
    cancer: tuple[np.ndarray, np.ndarray], iris: tuple[np.ndarray, np.ndarray]
) -> None:
    for X, y in (cancer, iris):
        ours = LogisticRegression(C=1.0, tol=1e-10).fit(X, y)
        ref = sk.LogisticRegression(C=1.0, tol=1e-12, max_iter=10_000).fit(X, y)
        np.testing.assert_allclose(ours.predict_log_proba(X), ref.predict_log_proba(X), atol=1e-5)
        np.testing.assert_allclose(np.exp(ours.predict_log_proba(X)), ours.predict_proba(X), atol=1e-12)


def test_predict_log_proba_is_finite_far_from_the_boundary(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    est = LogisticRegression().fit(X, y)
    far = X[:3] * 1e4
    assert np.isfinite(est.predict_log_proba(far)).all()
    assert (est.predict_proba(far) == 0).any()  # where log(predict_proba) would be -inf


def test_predict_log_proba_of_mlp_dask_and_generic(
    iris: tuple[np.ndarray, np.ndarray], client: Client
) -> None:
    import dask.array as da

    X, y = iris
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        mlp = MLPClassifier(hidden_layer_sizes=(4,), random_state=0, max_iter=20).fit(X, y)
        generic = ModelClassifier(models.Softmax(4, 3), max_iter=20).fit(X, y)
    for est in (mlp, generic):
        np.testing.assert_allclose(est.predict_log_proba(X), np.log(est.predict_proba(X)), atol=1e-12)
    for est in (mlp, generic, LogisticRegression().fit(X, y)):
        lazy = est.predict_log_proba(da.from_array(X, chunks=40))
        np.testing.assert_allclose(lazy.compute(), est.predict_log_proba(X), atol=1e-12)


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (np.ones(10), r"shape \(100,\), one weight per row"),
        (np.ones((100, 1)), r"shape \(100,\), one weight per row"),
        (np.r_[np.ones(99), -1.0], r"must be >= 0, got -1.0 at row 99; use 0 to leave a row out"),
        (np.r_[np.nan, np.ones(99)], r"must be finite, got nan at row 0"),
        (np.r_[np.ones(50), np.inf, np.ones(49)], r"must be finite, got inf at row 50"),
        (np.zeros(100), r"zero for every row"),
        (["a"] * 100, r"must hold numbers, one per row"),
        (sp.csr_array(np.ones((100, 1))), r"1-D numpy array or list of numbers"),
    ],
)
@pytest.mark.parametrize("est", [LogisticRegression, LinearRegression, MLPClassifier])
def test_bad_sample_weight_says_what_to_do(
    cancer: tuple[np.ndarray, np.ndarray], est: type, weights: Any, message: str
) -> None:
    X, y = cancer
    with pytest.raises(InvalidOptionError, match=message):
        est().fit(X[:100], y[:100], sample_weight=weights)


@pytest.mark.parametrize(
    ("class_weight", "message"),
    [
        ({5: 1.0}, r"keys \[5\] that are not classes of y; its keys must be among the classes \[0, 1\]"),
        ({0: -1.0}, r"class_weight\[0\] must be a finite number >= 0"),
        ({0: float("nan")}, r"class_weight\[0\] must be a finite number >= 0"),
        ({0: "x"}, r"class_weight\[0\] must be a finite number >= 0"),
        ("auto", r"class_weight must be None, 'balanced' or a dict"),
        ([1.0, 2.0], r"class_weight must be None, 'balanced' or a dict"),
    ],
)
def test_bad_class_weight_says_what_to_do(
    cancer: tuple[np.ndarray, np.ndarray], class_weight: Any, message: str
) -> None:
    X, y = cancer
    with pytest.raises(InvalidOptionError, match=message):
        LogisticRegression(class_weight=class_weight).fit(X, y)


def test_weights_refused_where_rows_cannot_carry_them(
    cancer: tuple[np.ndarray, np.ndarray], tmp_path: Any, client: Client
) -> None:

    X, y = cancer
    ds = Dataset.from_arrays(X, y, path=str(tmp_path / "d"), label_kind="binary")
    with pytest.raises(InvalidOptionError, match=r"need the rows in memory.*X.compute\(\)"):
        LogisticRegression().fit(ds, sample_weight=np.ones(len(y)))
    with pytest.raises(InvalidOptionError, match="need the rows in memory"):
        LogisticRegression(class_weight="balanced").fit(ds)
    held_out = {"eval_data": (X[:10], y[:10])}
    with pytest.raises(InvalidOptionError, match="drop eval_data"):
        LogisticRegression(solver="downpour", downpour_options=held_out).fit(
            X, y, sample_weight=np.ones(len(y))
        )


def test_generic_model_without_weights_says_what_to_do(iris: tuple[np.ndarray, np.ndarray]) -> None:
    class Unweighted:
        n_params = 15

        def init_params(self, seed: int | None = None) -> np.ndarray:
            return np.zeros(15)

        def loss_and_grad(self, w: Any, X: Any, y: Any) -> tuple[float, np.ndarray]:
            return models.Softmax(4, 3).loss_and_grad(w, X, y)

        def predict(self, w: Any, X: Any) -> np.ndarray:
            return models.Softmax(4, 3).predict(w, X)

    X, y = iris
    with pytest.raises(
        InvalidOptionError, match="Add that keyword to the model, or fit without sample_weight"
    ):
        ModelClassifier(Unweighted()).fit(X, y, sample_weight=np.ones(len(y)))
    opts: dict[str, Any] = dict(alpha=1.0, tol=1e-10)
    weighted = ModelClassifier(models.Softmax(4, 3), **opts).fit(X, y, sample_weight=np.full(len(y), 2.0))
    plain = ModelClassifier(models.Softmax(4, 3), alpha=0.5, tol=1e-10).fit(X, y)  # the same objective / 2
    np.testing.assert_allclose(weighted.w_, plain.w_, atol=1e-6)
