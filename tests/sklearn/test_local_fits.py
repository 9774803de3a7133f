"""Small data in memory without a client is fitted in this process (``minimize(local=True)``): the same fit
as on the cluster, no cluster started; a client given, or data past the bounds, goes to the cluster."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from distributed import Client
from sklearn.datasets import load_breast_cancer

from distbelief import models
from distbelief.sklearn import LogisticRegression
from distbelief.sklearn._base import LOCAL_MAX_PARAMS, LOCAL_MAX_WORK, fits_in_process


def test_a_small_fit_runs_here_and_equals_the_clusters(client: Client) -> None:
    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    here = LogisticRegression(C=0.5, tol=1e-8).fit(X, y)
    there = LogisticRegression(C=0.5, tol=1e-8, client=client).fit(X, y)
    assert here.result_.stats["local"] is True and "replicas" in there.result_.stats
    assert here.n_iter_ == there.n_iter_
    np.testing.assert_allclose(here.coef_, there.coef_, rtol=1e-8, atol=1e-10)


def test_the_bounds_send_wide_or_heavy_data_to_the_cluster() -> None:
    narrow = models.Logistic(30)
    assert fits_in_process((np.zeros((100, 30)), np.zeros(100)), narrow)
    rows = int(LOCAL_MAX_WORK / 31) + 1000  # one more row's worth of work than the bound
    assert not fits_in_process((np.zeros((rows, 30)), np.zeros(rows)), narrow)
    wide = models.Logistic(LOCAL_MAX_PARAMS)
    X = sp.random_array((10, LOCAL_MAX_PARAMS), density=1e-5, format="csr")
    assert not fits_in_process((X, np.zeros(10)), wide)
    assert not fits_in_process("a dataset", narrow)
