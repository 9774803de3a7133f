"""Progress of the estimators' fits: ``verbose`` (a tqdm bar with the objective, INFO logs), ``callback``."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer
from sklearn.exceptions import ConvergenceWarning
from sklearn.preprocessing import StandardScaler

from distbelief.errors import InvalidOptionError
from distbelief.sandblaster import IterationRecord
from distbelief.sklearn import LinearRegression, LogisticRegression, MLPClassifier, ModelClassifier, _base


@pytest.fixture(scope="module")
def cancer() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y


def test_callback_sees_every_iteration(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    seen: list[Any] = []
    est = LogisticRegression(tol=1e-8, callback=seen.append).fit(X, y)
    assert len(seen) == est.n_iter_[0] >= 2
    assert all(isinstance(r, IterationRecord) for r in seen)
    assert [r.iteration for r in seen] == list(range(1, len(seen) + 1))
    assert seen[-1].objective == pytest.approx(est.result_.fun)


def test_callback_stops_the_fit(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer

    def stop_at_3(record: IterationRecord) -> None:
        if record.iteration >= 3:
            raise StopIteration

    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)  # stopped by the user: not a failure to converge
        est = LogisticRegression(tol=1e-12, callback=stop_at_3).fit(X, y)
    assert est.n_iter_[0] == 3 and est.result_.status == 3


def test_downpour_callback_gets_progress(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    from distbelief.downpour import Progress

    X, y = cancer
    seen: list[Any] = []

    def stop_at_first(progress: Any) -> None:
        seen.append(progress)
        raise StopIteration

    # Downpour calls back with the rows it records while it runs (none in a run shorter than a poll), so a
    # long run, stopped by the callback.
    est = LogisticRegression(solver="downpour", max_iter=10_000, callback=stop_at_first).fit(X, y)
    assert len(seen) == 1 and isinstance(seen[0], Progress)
    assert est.result_.stop_reason == "callback"


@pytest.mark.parametrize("est", [LinearRegression, MLPClassifier])
def test_every_estimator_forwards_its_callback(cancer: tuple[np.ndarray, np.ndarray], est: type) -> None:
    X, y = cancer
    seen: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fitted = est(max_iter=5, callback=seen.append).fit(X[:100], y[:100])
    assert len(seen) == fitted.n_iter_


def test_verbose_logs_every_iteration_at_info(
    cancer: tuple[np.ndarray, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    X, y = cancer
    with caplog.at_level(logging.INFO, logger="distbelief"):
        est = LogisticRegression(verbose=1).fit(X, y)
    lines = [r.getMessage() for r in caplog.records if r.name == "distbelief.sklearn"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "distbelief.sklearn")
    assert lines[0].startswith("LogisticRegression: fitting 569 rows with solver='lbfgs'")
    assert sum("objective" in line and "iteration" in line for line in lines) == est.n_iter_[0]
    assert "stopped after" in lines[-1]


def test_quiet_logs_only_start_and_end_at_info(
    cancer: tuple[np.ndarray, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    X, y = cancer
    with caplog.at_level(logging.INFO, logger="distbelief"):
        LogisticRegression().fit(X, y)
    lines = [r.getMessage() for r in caplog.records if r.name == "distbelief.sklearn"]
    assert len(lines) == 2 and "fitting" in lines[0] and "stopped after" in lines[1]


def test_verbose_shows_a_bar_with_the_objective(
    cancer: tuple[np.ndarray, np.ndarray], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bar appears once a fit has run PROGRESS_DELAY seconds (2 s): here 0, so this short fit shows it."""
    X, y = cancer
    monkeypatch.setattr(_base, "PROGRESS_DELAY", 0.0)
    LogisticRegression(verbose=1).fit(X, y)
    err = capsys.readouterr().err
    assert "LogisticRegression" in err and "objective=" in err


def test_short_fits_and_quiet_fits_print_nothing(
    cancer: tuple[np.ndarray, np.ndarray], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    X, y = cancer
    LogisticRegression(verbose=1).fit(X, y)  # well under 2 s
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(_base, "PROGRESS_DELAY", 0.0)
    LogisticRegression(verbose=0).fit(X, y)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("bad", [-1, 1.5, "yes", None])
def test_bad_verbose_says_what_to_pass(cancer: tuple[np.ndarray, np.ndarray], bad: Any) -> None:
    X, y = cancer
    with pytest.raises(
        InvalidOptionError, match=r"verbose must be an int >= 0 \(0: quiet, 1: a progress bar"
    ):
        LogisticRegression(verbose=bad).fit(X, y)


@pytest.mark.parametrize("est", [LogisticRegression, LinearRegression, MLPClassifier])
@pytest.mark.parametrize("bad", ["print", 3, [print]])
def test_bad_callback_says_what_to_pass(cancer: tuple[np.ndarray, np.ndarray], est: type, bad: Any) -> None:
    X, y = cancer
    with pytest.raises(InvalidOptionError, match="callback must be None or a function of one argument"):
        est(callback=bad).fit(X, y)


def test_generic_classifier_checks_them_too(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    from distbelief import models

    X, y = cancer
    with pytest.raises(InvalidOptionError, match="callback must be None"):
        ModelClassifier(models.Logistic(30), callback="x").fit(X, y)
    with pytest.raises(InvalidOptionError, match="verbose must be an int"):
        ModelClassifier(models.Logistic(30), verbose=-2).fit(X, y)
