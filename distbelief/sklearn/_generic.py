"""``ModelClassifier``: any distbelief model (a ``models.JaxModel``, a custom one) as a classifier."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError
from distbelief.models import Model

from ._base import check_alpha, check_common
from ._estimators import _ModelProba

__all__ = ["ModelClassifier"]


class ModelClassifier(_ModelProba):
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
    solver, max_iter, tol, warm_start, verbose, callback, client, store, downpour_options
        As in :class:`LogisticRegression`.
    random_state : int or None
        Seed of ``model.init_params``.

    Examples
    --------
    >>> clf = ModelClassifier(models.JaxModel(loss, example_params=p, predict_fn=pred))  # doctest: +SKIP
    >>> clf.fit(X, y).score(X, y)                                                       # doctest: +SKIP
    0.98
    """

    def __init__(
        self,
        model: Model | None = None,
        *,
        alpha: float = 0.0,
        solver: str = "lbfgs",
        max_iter: int = 200,
        tol: float = 1e-5,
        random_state: int | None = None,
        warm_start: bool = False,
        verbose: int = 0,
        callback: Any = None,
        client: Any = None,
        store: str | None = None,
        downpour_options: dict[str, Any] | None = None,
    ) -> None:
        self._keep_params(locals())

    def _check_options(self, name: str, sample_weight: Any) -> None:
        if self.model is None or not callable(getattr(self.model, "loss_and_grad", None)):
            raise InvalidOptionError(
                f"{name}: model must be a distbelief model (with loss_and_grad), got {self.model!r}"
            )
        check_common(self.solver, "l2", self.max_iter, self.tol, name)
        check_alpha(self.alpha, name)
        if sample_weight is not None and not _takes_sample_weight(self.model):
            raise InvalidOptionError(
                f"{name}: sample_weight needs a model whose loss_and_grad(w, X, y, *, sample_weight) takes "
                f"per-row weights; {type(self.model).__name__}'s does not. Add that keyword to the model, or "
                "fit without sample_weight"
            )

    def _model(self, n: int, seed: int | None) -> tuple[Model, dict[str, Any]]:
        x0 = np.asarray(self.model.init_params(seed), dtype=np.float64)
        return self.model, {"l2": float(self.alpha) / n, "free": [], "x0": x0}

    def predict(self, X: Any) -> Any:
        """The classes ``model.predict(w_, X)`` points at."""
        if self._is_lazy(X):
            return self._lazy(X, "predict", None, self.classes_.dtype)
        rows = self._rows(X)
        index = np.asarray(self.model_.predict(self.w_, rows)).astype(np.intp)
        return self.classes_[index]


def _takes_sample_weight(model: Model) -> bool:
    """Whether ``model.loss_and_grad`` has a ``sample_weight`` keyword (or takes any keyword)."""
    try:
        params = inspect.signature(model.loss_and_grad).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "sample_weight" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
