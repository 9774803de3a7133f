"""``Client.estimator``: a finished service job as a fitted scikit-learn estimator."""

from __future__ import annotations

import numpy as np
import pytest

from distbelief import models
from distbelief.api import ApiError, Client
from distbelief.sklearn import LogisticRegression
from tests.api.conftest import LOGISTIC, TOKEN, tiny_xy


def test_a_finished_job_is_a_fitted_estimator(server: str) -> None:
    X, y = tiny_xy()
    with Client(server, TOKEN) as api:
        job = api.submit({"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC})
        record = api.wait(job["id"], timeout=120, progress=False)
        assert record["status"] == "succeeded"
        est = api.estimator(job["id"])
        w = api.params(job["id"])
    assert isinstance(est, LogisticRegression)
    model = models.from_spec(LOGISTIC)
    assert isinstance(model, models.Logistic)
    np.testing.assert_array_equal(est.predict(X), model.predict(w, X))
    np.testing.assert_allclose(est.predict_proba(X)[:, 1], model.predict_proba(w, X))
    assert est.score(X, y) == pytest.approx(model.accuracy(w, X, y))
    assert est.n_iter_[0] == record["result"]["nit"]


def test_an_unfinished_or_missing_job_is_refused(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(server, TOKEN) as api:
        with pytest.raises(ApiError, match=r"404|not found|no job"):
            api.estimator("no-such-job")
        # A job still running (the record as the server reports it), without racing a real one.
        monkeypatch.setattr(api, "job", lambda job_id: {"id": job_id, "status": "running"})
        with pytest.raises(ApiError, match="is running, not succeeded"):
            api.estimator("abc")
