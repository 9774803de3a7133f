"""Estimators fitted in other processes: ``GridSearchCV(n_jobs=2)`` runs its fits in joblib (loky) worker
processes, each with its own embedded cluster (worker threads: a loky worker cannot start Dask's nannies)."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import GridSearchCV
from sklearn.preprocessing import StandardScaler

from distbelief.sklearn import LogisticRegression


def test_grid_search_with_two_processes() -> None:
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    grid = {"C": [0.1, 1.0]}
    parallel = GridSearchCV(LogisticRegression(), grid, cv=2, n_jobs=2, error_score="raise").fit(X, y)
    serial = GridSearchCV(LogisticRegression(), grid, cv=2).fit(X, y)
    np.testing.assert_allclose(
        parallel.cv_results_["mean_test_score"], serial.cv_results_["mean_test_score"], atol=1e-12
    )
    assert parallel.best_params_ == serial.best_params_
