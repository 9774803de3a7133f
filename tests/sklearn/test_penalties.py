"""penalty="l1" and "elasticnet" (OWL-QN) against scikit-learn's saga and liblinear: the objective to 1e-6
relative and the same zero pattern, with the intercept left out of the penalty as scikit-learn does."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
import sklearn.linear_model as sk
from distributed import Client
from sklearn.datasets import load_breast_cancer, load_iris
from sklearn.preprocessing import StandardScaler

from distbelief.errors import InvalidOptionError
from distbelief.sklearn import LogisticRegression, SoftmaxRegression

TIGHT: dict[str, Any] = {"tol": 1e-9, "max_iter": 3000}


@pytest.fixture(scope="module")
def cancer() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y


def _reference(X: Any, y: np.ndarray, **params: Any) -> sk.LogisticRegression:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # penalty= is deprecated from scikit-learn 1.8; saga's slow end
        return sk.LogisticRegression(tol=1e-12, max_iter=200_000, **params).fit(X, y)


def _objective(est: Any, X: Any, y: np.ndarray, C: float, r: float) -> float:
    """scikit-learn's: C * sum of the cross-entropy + r ||coef||_1 + ((1 - r) / 2) ||coef||^2."""
    P = np.clip(est.predict_proba(X), 1e-300, None)
    loss = -np.log(P[np.arange(len(y)), np.searchsorted(est.classes_, y)]).sum()
    coef = est.coef_
    return float(C * loss + r * np.abs(coef).sum() + 0.5 * (1 - r) * (coef * coef).sum())


def _same_fit(ours: Any, ref: Any, X: Any, y: np.ndarray, C: float, r: float) -> None:
    f_ours, f_ref = _objective(ours, X, y, C, r), _objective(ref, X, y, C, r)
    assert f_ours <= f_ref * (1 + 1e-6), (f_ours, f_ref)
    assert f_ours == pytest.approx(f_ref, rel=1e-6)
    np.testing.assert_array_equal(ours.coef_ != 0, np.abs(ref.coef_) > 1e-8)
    assert 0 < np.count_nonzero(ours.coef_) < ours.coef_.size  # a sparse solution, not all or nothing


@pytest.mark.parametrize("C", [0.05, 0.5])
def test_l1_matches_saga(cancer: tuple[np.ndarray, np.ndarray], C: float) -> None:
    X, y = cancer
    ours = LogisticRegression(penalty="l1", C=C, **TIGHT).fit(X, y)
    assert "nnz" in ours.result_.history  # OWL-QN ran (its history counts the nonzeros)
    ref = _reference(X, y, penalty="l1", solver="saga", C=C)
    _same_fit(ours, ref, X, y, C, 1.0)
    # The intercept is not penalized: saga's is the same to the precision of the fit.
    assert ours.intercept_[0] == pytest.approx(ref.intercept_[0], abs=1e-4)


def test_l1_without_intercept_matches_liblinear(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    ours = LogisticRegression(penalty="l1", C=0.1, fit_intercept=False, **TIGHT).fit(X, y)
    ref = _reference(X, y, penalty="l1", solver="liblinear", C=0.1, fit_intercept=False)
    _same_fit(ours, ref, X, y, 0.1, 1.0)
    assert ours.intercept_.tolist() == [0.0]


def test_elasticnet_matches_saga(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    ours = LogisticRegression(penalty="elasticnet", l1_ratio=0.6, C=0.1, **TIGHT).fit(X, y)
    ref = _reference(X, y, penalty="elasticnet", l1_ratio=0.6, solver="saga", C=0.1)
    _same_fit(ours, ref, X, y, 0.1, 0.6)


def test_multinomial_l1_matches_saga() -> None:
    X, y = load_iris(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    ours = SoftmaxRegression(penalty="l1", C=0.5, **TIGHT).fit(X, y)
    ref = _reference(X, y, penalty="l1", solver="saga", C=0.5)
    assert ours.coef_.shape == ref.coef_.shape == (3, 4)
    f_ours, f_ref = _objective(ours, X, y, 0.5, 1.0), _objective(ref, X, y, 0.5, 1.0)
    assert f_ours == pytest.approx(f_ref, rel=1e-6)


def test_l1_on_sparse_rows_matches_saga(client: Client) -> None:
    rng = np.random.default_rng(5)
    X = sp.random_array((400, 80), density=0.1, format="csr", rng=rng)
    X.data = rng.normal(size=X.nnz)
    y = (X @ np.where(np.arange(80) < 8, 2.0, 0.0) + rng.logistic(size=400) > 0).astype(int)
    ours = LogisticRegression(penalty="l1", C=0.2, client=client, **TIGHT).fit(X, y)  # the cluster's path
    assert ours.result_.stats["communication"] == "sparse"
    ref = _reference(X, y, penalty="l1", solver="saga", C=0.2)
    _same_fit(ours, ref, X, y, 0.2, 1.0)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"penalty": "elasticnet"}, "needs l1_ratio"),
        ({"penalty": "elasticnet", "l1_ratio": 1.5}, "needs l1_ratio"),
        ({"penalty": "l2", "l1_ratio": 0.5}, "penalty='elasticnet'"),
        ({"penalty": "l1", "solver": "cg"}, "solver='lbfgs'"),
        ({"penalty": "l1", "solver": "downpour"}, "solver='lbfgs'"),
        ({"penalty": "l3"}, "penalty must be one of"),
    ],
)
def test_bad_penalty_options_are_refused_with_a_message(params: dict[str, Any], match: str) -> None:
    X, y = np.eye(4), np.array([0, 1, 0, 1])
    with pytest.raises(InvalidOptionError, match=match):
        LogisticRegression(**params).fit(X, y)
