"""``ModelClassifier``: any distbelief model (a ``models.JaxModel``, a custom one) as a classifier."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
from sklearn.base import ClassifierMixin

from distbelief.errors import InvalidOptionError

from ._base import check_alpha, check_common, fit_store
from ._estimators import _Distbelief

__all__ = ["ModelClassifier"]


class ModelClassifier(ClassifierMixin, _Distbelief):
    """A classifier around any model with ``loss_and_grad`` and ``predict(w, X)`` (class indices).

    The labels are encoded as ``0..n_classes-1`` (``classes_`` holds the originals) before the model sees
    them, so ``model.predict`` returns indices into ``classes_``. The objective is
    ``F(w) = (1/N) sum_i loss_i + (l2/2) ||w||^2`` with ``l2 = alpha / N`` on every parameter (the model's
    layout is unknown here, so nothing is left unpenalized).

    Parameters
    ----------
    model : Model
        E.g. ``models.JaxModel(loss_fn, ..., predict_fn=...)``; ``predict_proba(w, X)`` is used if present.
    alpha : float
        L2 strength (>= 0), as ``alpha`` of scikit-learn's ``MLPClassifier``.
    solver, max_iter, tol, client, store, downpour_options
        As in :class:`LogisticRegression`.
    random_state : int or None
        Seed of ``model.init_params``.

    Examples
    --------
    >>> clf = ModelClassifier(models.JaxModel(loss, example_params=p, predict_fn=pred))  # doctest: +SKIP
    >>> clf.fit(X, y).score(X, y)                                                       # doctest: +SKIP
    0.98
    """

    _classifier = True

    def __init__(
        self,
        model: Any = None,
        *,
        alpha: float = 0.0,
        solver: str = "lbfgs",
        max_iter: int = 200,
        tol: float = 1e-5,
        random_state: int | None = None,
        client: Any = None,
        store: str | None = None,
        downpour_options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.alpha = alpha
        self.solver = solver
        self.max_iter = max_iter
        self.tol = tol
        self.random_state = random_state
        self.client = client
        self.store = store
        self.downpour_options = downpour_options

    def fit(self, X: Any, y: Any = None) -> ModelClassifier:
        """Fit ``model`` on ``X`` (numpy, Dask array or ``storage.Dataset``) and labels ``y``.

        Returns
        -------
        self
        """
        name = type(self).__name__
        if self.model is None or not callable(getattr(self.model, "loss_and_grad", None)):
            raise InvalidOptionError(
                f"{name}: model must be a distbelief model (with loss_and_grad), got {self.model!r}"
            )
        check_common(self.solver, "l2", self.max_iter, self.tol, name)
        check_alpha(self.alpha, name)
        if self.random_state is not None and not isinstance(self.random_state, numbers.Integral):
            raise InvalidOptionError(
                f"{name}: random_state must be None or an int, got {self.random_state!r}"
            )
        with fit_store(self.store) as store:
            data, n = self._data(X, y, store)
            seed = None if self.random_state is None else int(self.random_state)
            self._fit_with(
                self.model, data, l2=float(self.alpha) / n, free=[], store=store,
                x0=np.asarray(self.model.init_params(seed), dtype=np.float64), seed=seed or 0,
                downpour_options=self.downpour_options,
            )  # fmt: skip
        self.n_iter_ = self._nit
        return self

    def predict_proba(self, X: Any) -> Any:
        """``model.predict_proba(w_, X)`` (only if the model has one)."""
        rows = self._rows(X)
        method = getattr(self.model_, "predict_proba", None)
        if not callable(method):
            raise AttributeError(f"{type(self.model_).__name__} has no predict_proba")
        return np.asarray(method(self.w_, rows), dtype=np.float64)

    def predict(self, X: Any) -> Any:
        """The classes ``model.predict(w_, X)`` points at."""
        rows = self._rows(X)
        index = np.asarray(self.model_.predict(self.w_, rows)).astype(np.intp)
        return self.classes_[index]
