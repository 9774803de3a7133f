"""scikit-learn's own estimator checks, on every estimator (small models: check_estimator fits often)."""

from __future__ import annotations

from typing import Any

from sklearn.utils.estimator_checks import parametrize_with_checks

from distbelief.sklearn import LinearRegression, LogisticRegression, MLPClassifier, SoftmaxRegression

ESTIMATORS = [
    LogisticRegression(),
    SoftmaxRegression(),
    LinearRegression(),
    MLPClassifier(hidden_layer_sizes=(8,), max_iter=300, random_state=0),
]

#: Checks expected to fail, with the reason (none so far; see the report of issue 16 if this grows).
EXPECTED_FAILED: dict[str, dict[str, str]] = {}


def _expected_failed(estimator: Any) -> dict[str, str]:
    return EXPECTED_FAILED.get(type(estimator).__name__, {})


@parametrize_with_checks(ESTIMATORS, expected_failed_checks=_expected_failed)
def test_sklearn_compatible(estimator: Any, check: Any) -> None:
    check(estimator)
