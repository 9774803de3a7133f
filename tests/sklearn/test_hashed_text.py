"""Hashed text (HashingVectorizer, 2^18 columns) through LogisticRegression: sparse rows all the way, and
scikit-learn's lbfgs objective reached to 1e-6 relative."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import sklearn.linear_model as sk
from sklearn.feature_extraction.text import HashingVectorizer

from benchmarks.hashed_text import documents as _documents
from distbelief.sklearn import LogisticRegression


def test_hashed_text_reaches_sklearn_lbfgs_objective() -> None:
    docs, y = _documents(5000)
    X = HashingVectorizer(n_features=2**18).transform(docs)
    assert X.shape == (5000, 2**18) and X.nnz < 5000 * 40
    C = 1.0
    t0 = time.perf_counter()
    ours = LogisticRegression(C=C, tol=1e-7, max_iter=2000).fit(X, y)
    ours_s = time.perf_counter() - t0
    assert ours.result_.stats["communication"] == "sparse"
    # scikit-learn's lbfgs on the columns the documents touch: the same problem (an untouched column's
    # coefficient only costs 0.5 w^2, so it is 0 at the optimum), without 2^18-wide L-BFGS-B steps (0.1 s
    # each in SciPy's setulb here).
    cols = np.unique(X.indices)
    assert cols.size < 4000
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        narrow = sk.LogisticRegression(C=C, solver="lbfgs", tol=1e-10, max_iter=5000).fit(X[:, cols], y)
    ref_s = time.perf_counter() - t0
    ref = sk.LogisticRegression(C=C)
    ref.classes_, ref.intercept_ = narrow.classes_, narrow.intercept_
    ref.coef_ = np.zeros((1, X.shape[1]))
    ref.coef_[0, cols] = narrow.coef_[0]
    untouched = np.ones(X.shape[1], dtype=bool)
    untouched[cols] = False
    assert np.all(ours.coef_[0, untouched] == 0.0)

    def objective(est: LogisticRegression | sk.LogisticRegression) -> float:
        z = X @ est.coef_[0] + est.intercept_[0]
        return float(C * np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * est.coef_[0] @ est.coef_[0])

    f_ours, f_ref = objective(ours), objective(ref)
    print(f"hashed text 5000 x 2^18: ours {ours_s:.1f} s ({ours.n_iter_[0]} it), scikit-learn {ref_s:.1f} s")
    assert f_ours == pytest.approx(f_ref, rel=1e-6)
    assert f_ours <= f_ref * (1 + 1e-6)
    assert np.mean(ours.predict(X) == ref.predict(X)) > 0.999
