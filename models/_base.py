"""The Model protocol, the shared base of the built-in models, and the reference objective.

DESIGN.md "Models": a model returns the *sum* of per-example losses over the rows it is given and the
gradient of that sum; the optimizers minimize ``F(w) = (1/N) * sum_i loss_i(w) + (l2/2) * ||w||^2``, with
the data term summed over portions by replicas and the regularizer applied on the parameter-server shards.
"""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike, NDArray

from distbelief.errors import DatasetError, InvalidOptionError

from . import _checks
from ._checks import LabelKind

__all__ = ["Model", "objective"]

FloatArray = NDArray[np.float64]


@runtime_checkable
class Model(Protocol):
    """What the optimizers need from a model.

    Anything with these three members is a model; the built-ins (:class:`models.LeastSquares`,
    :class:`models.Logistic`, :class:`models.Softmax`, :class:`models.MLP`) also have ``n_features``,
    ``spec``, ``label_kind``, ``n_classes``, ``check_labels``, ``predict`` and (classifiers) ``accuracy``.

    Rows ``X``: a C-contiguous float64 ndarray for a dense dataset, and a ``scipy.sparse.csr_array``
    (float64 ``data``, int32 or int64 ``indices``, sorted, no duplicates) for a sparse one
    (``Dataset.layout == "csr"``, e.g. built from a ``scipy.sparse`` matrix or svmlight text). In both cases
    the rows may be read-only (they are shared by the replicas of a worker): never write into them. A model
    that only supports dense rows should raise ``DatasetError`` saying so (as :class:`models.MLP` does);
    the linear built-ins take both.

    Attributes
    ----------
    n_params : int
        Length of the flat float64 parameter vector.

    Examples
    --------
    >>> from distbelief.models import Logistic
    >>> isinstance(Logistic(3), Model)
    True
    """

    @property
    def n_params(self) -> int:
        """Length of the flat parameter vector."""
        ...

    def init_params(self, seed: int | None = None) -> FloatArray:
        """A starting parameter vector of length ``n_params``."""
        ...

    def loss_and_grad(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> tuple[float, FloatArray]:
        """Sum of the per-example losses over the rows ``X`` (labels ``y``) and its gradient in ``w``.

        The built-in models take ``w`` (shape (n_params,)), ``X`` (shape (n_rows, n_features); float64 input
        is used as is, never copied) and ``sample_weight`` (shape (n_rows,), optional): per-row weights
        ``s_i >= 0``, the loss becomes ``sum_i s_i loss_i`` with its gradient (scikit-learn's meaning).
        """
        ...


class ModelBase:
    """Behaviour shared by the built-in models (private: the public contract is :class:`Model`)."""

    kind: ClassVar[str]
    label_kind: ClassVar[LabelKind]
    _name: ClassVar[str]  # used in error messages, e.g. "logistic regression"

    @property
    def n_params(self) -> int:
        """Length of the flat parameter vector."""
        raise NotImplementedError

    @property
    def n_features(self) -> int:
        """Number of input features (columns of ``X``)."""
        raise NotImplementedError

    @property
    def n_classes(self) -> int | None:
        """Number of classes (2 for binary labels), or None for real-valued targets."""
        raise NotImplementedError

    @property
    def spec(self) -> dict[str, Any]:
        """JSON-able description; ``models.from_spec(model.spec)`` rebuilds an equal model."""
        raise NotImplementedError

    def predict(self, w: ArrayLike, X: ArrayLike) -> NDArray[Any]:  # pragma: no cover - overridden
        raise NotImplementedError

    def check_labels(self, y: ArrayLike) -> None:
        """Check that ``y`` holds labels this model can be trained on.

        Parameters
        ----------
        y : array_like, shape (n_rows,)
            Real targets (``label_kind == "real"``), 0/1 labels (``"binary"``) or integer class labels
            ``0..n_classes-1`` (``"classes"``; integral floats are accepted).

        Raises
        ------
        distbelief.errors.DatasetError
            Saying which labels were expected and where the first bad one is.

        Examples
        --------
        >>> from distbelief.models import Logistic
        >>> Logistic(2).check_labels([0, 1, 1])
        >>> Logistic(2).check_labels([0, 2])
        Traceback (most recent call last):
        ...
        distbelief.errors.DatasetError: logistic regression expects binary labels 0 or 1; ...
        """
        arr = np.asarray(y)
        if arr.ndim != 1:
            raise DatasetError(
                f"{self._name} expects a 1-D array of labels, got shape {arr.shape}; pass one label per row"
            )
        arr = _checks.as_targets(arr, arr.shape[0], self._name)
        if self.label_kind == "real":
            _checks.real_labels(arr, self._name)
        elif self.label_kind == "binary":
            _checks.binary_labels(arr, self._name)
        else:
            assert self.n_classes is not None
            _checks.class_labels(arr, self.n_classes, self._name)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.spec.items() if k != "kind")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelBase):
            return NotImplemented
        return type(self) is type(other) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(json.dumps(self.spec, sort_keys=True))


class ClassifierBase(ModelBase):
    """Behaviour shared by the built-in classifiers: the most probable class and the accuracy (private)."""

    def _logits(self, w: ArrayLike, X: ArrayLike) -> FloatArray:  # pragma: no cover - overridden
        raise NotImplementedError

    def predict(self, w: ArrayLike, X: ArrayLike) -> NDArray[np.int64]:
        """Most probable class of every row (int64), shape (n_rows,).

        Examples
        --------
        >>> from distbelief.models import MLP, LocallyConnected
        >>> MLP([1, 2]).predict([1.0, -1.0, 0.0, 0.0], [[2.0], [-2.0]])  # no hidden layer: W (1, 2), b (2,)
        array([0, 1])
        >>> m = LocallyConnected(4, 2, fields=[2], strides=[2])
        >>> m.predict(np.zeros(m.n_params), np.ones((3, 4))).shape
        (3,)
        """
        labels: NDArray[np.int64] = np.argmax(self._logits(w, X), axis=1).astype(np.int64)
        return labels

    def accuracy(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> float:
        """Fraction of rows whose predicted class equals ``y``.

        Examples
        --------
        >>> from distbelief.models import Logistic, MLP
        >>> Logistic(1).accuracy([1.0, 0.0], [[-2.0], [3.0]], [0, 0])
        0.5
        >>> MLP([1, 2]).accuracy([1.0, -1.0, 0.0, 0.0], [[2.0], [-2.0]], [0, 0])
        0.5
        """
        self.check_labels(y)
        y_arr = np.asarray(y)
        labels = self.predict(w, X)
        if labels.shape != y_arr.shape:
            raise DatasetError(
                f"{self._name}: got {y_arr.shape[0]} labels for {labels.shape[0]} rows; pass one per row"
            )
        if labels.size == 0:
            raise DatasetError(f"{self._name}: accuracy of zero rows is undefined; pass at least one row")
        return float(np.count_nonzero(labels == y_arr)) / labels.size


def softmax_(Z: FloatArray) -> FloatArray:
    """``softmax(Z)`` of every row of logits ``Z``, in place (shifted by the row's maximum: no overflow)."""
    Z -= Z.max(axis=1, keepdims=True)
    np.exp(Z, out=Z)
    Z /= Z.sum(axis=1, keepdims=True)
    return Z


def objective(
    model: Model,
    w: ArrayLike,
    X: ArrayLike,
    y: ArrayLike,
    *,
    l2: float = 0.0,
    n_total: int | None = None,
) -> tuple[float, FloatArray]:
    """The objective the optimizers minimize, computed in one process (the reference implementation).

    ``F(w) = (1/N) * sum_i loss_i(w) + (l2/2) * ||w||^2`` and its gradient, where the sum runs over the
    rows given and ``N = n_total`` (or ``len(X)``). Passing ``n_total`` lets a caller evaluate the
    contribution of one portion of a larger data set: summing the data terms of all portions (and adding
    the regularizer once) gives the full objective.

    Parameters
    ----------
    model : Model
        Any object following the :class:`Model` protocol.
    w : array_like, shape (model.n_params,)
        Parameters.
    X : array_like or scipy.sparse matrix, shape (n_rows, n_features)
        Rows.
    y : array_like, shape (n_rows,)
        Labels.
    l2 : float, optional
        L2 regularization strength (>= 0); applies to every parameter, intercepts included.
    n_total : int, optional
        The N to divide the summed loss by; defaults to ``len(X)``.

    Returns
    -------
    value : float
    grad : ndarray, shape (model.n_params,)

    Raises
    ------
    distbelief.errors.InvalidOptionError
        If ``l2`` is negative or not finite, or ``n_total`` is not a positive integer (or X is empty and
        ``n_total`` is not given).

    Examples
    --------
    >>> import numpy as np
    >>> from distbelief.models import LeastSquares
    >>> m = LeastSquares(1, fit_intercept=False)
    >>> objective(m, np.array([2.0]), np.array([[1.0], [1.0]]), np.array([0.0, 0.0]), l2=1.0)
    (4.0, array([4.]))
    """
    l2_value = float(l2)
    if not math.isfinite(l2_value) or l2_value < 0:
        raise InvalidOptionError(f"l2 must be a finite number >= 0, got {l2!r}")
    if n_total is None:
        n = int(cast(Any, X).shape[0]) if _checks.is_sparse(X) else len(np.asarray(X))
        if n == 0:
            raise InvalidOptionError("X has no rows: pass n_total, the number of rows to average over")
    else:
        if isinstance(n_total, bool) or not isinstance(n_total, int | np.integer) or n_total < 1:
            raise InvalidOptionError(f"n_total must be a positive integer (a row count), got {n_total!r}")
        n = int(n_total)
    loss, grad = model.loss_and_grad(w, X, y)
    grad = grad / n
    value = loss / n
    if l2_value:
        w_arr = np.asarray(w, dtype=np.float64)
        value += 0.5 * l2_value * float(w_arr @ w_arr)
        grad += l2_value * w_arr
    return float(value), grad
