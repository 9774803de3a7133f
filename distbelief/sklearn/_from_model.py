"""A fitted estimator from a model and its parameters (a result, a saved run, a service job)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from distbelief import models
from distbelief.errors import InvalidOptionError

from ._estimators import (
    LinearRegression,
    LogisticRegression,
    MLPClassifier,
    SoftmaxRegression,
)

__all__ = ["from_model"]

_ACTIVATION_NAMES = {"sigmoid": "logistic", "tanh": "tanh", "relu": "relu"}


def from_model(
    model: Any, w: ArrayLike, *, classes: ArrayLike | None = None, n_iter: int = 0, **params: Any
) -> LogisticRegression | SoftmaxRegression | LinearRegression | MLPClassifier:
    """The fitted scikit-learn estimator that a built-in model at parameters ``w`` is.

    Parameters
    ----------
    model : built-in model or its spec (dict)
        ``Logistic`` -> :class:`LogisticRegression`, ``Softmax`` -> :class:`SoftmaxRegression`,
        ``LeastSquares`` -> :class:`LinearRegression`, ``MLP`` -> :class:`MLPClassifier`.
    w : array_like, shape (model.n_params,)
        The parameters (``result.x``, a job's ``params``).
    classes : array_like, optional
        The labels of the classes (default ``0..n_classes-1``, the labels a dataset holds).
    n_iter : int
        Iterations of the run (``n_iter_``).
    **params
        Estimator options (``client=``, ``C=``, ...) for refitting later.

    Raises
    ------
    InvalidOptionError
        ``model`` is not a built-in model or spec, or ``w`` has the wrong length.

    Examples
    --------
    >>> import numpy as np
    >>> est = from_model({"kind": "logistic", "n_features": 2}, np.array([1.0, -1.0, 0.5]))
    >>> est.coef_, est.intercept_, est.predict(np.array([[2.0, 0.0]]))
    (array([[ 1., -1.]]), array([0.5]), array([1]))
    """
    if isinstance(model, Mapping):
        model = models.from_spec(model)
    model = getattr(model, "model", model) if not isinstance(model, models.Model) else model
    if not isinstance(model, models.LeastSquares | models.Logistic | models.Softmax | models.MLP):
        raise InvalidOptionError(
            f"from_model needs a built-in model (Logistic, Softmax, LeastSquares, MLP) or its spec, got "
            f"{type(model).__name__}"
        )
    w_arr = np.asarray(w, dtype=np.float64).ravel()
    if w_arr.shape != (model.n_params,):
        raise InvalidOptionError(f"w has {w_arr.size} values but the model has {model.n_params} parameters")
    est: Any
    if isinstance(model, models.LeastSquares):
        est = LinearRegression(fit_intercept=model.fit_intercept, **params)
    elif isinstance(model, models.Logistic | models.Softmax):
        cls = LogisticRegression if isinstance(model, models.Logistic) else SoftmaxRegression
        est = cls(fit_intercept=model.fit_intercept, **params)
    else:
        hidden = tuple(model.layer_sizes[1:-1])
        est = MLPClassifier(hidden, activation=_ACTIVATION_NAMES[model.activation], **params)
    est._fitted(model, w_arr, int(n_iter), None)
    k = getattr(model, "n_classes", None)
    if k is not None:
        est.classes_ = np.arange(k) if classes is None else np.asarray(classes)
        if est.classes_.shape != (k,):
            raise InvalidOptionError(f"classes must list the model's {k} classes, got {est.classes_!r}")
    est.n_features_in_ = model.n_features
    out: LogisticRegression | SoftmaxRegression | LinearRegression | MLPClassifier = est
    return out
