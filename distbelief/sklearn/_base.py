"""What the estimators share: the cluster to fit on, the data to fit, the solver call, cloning and pickling.

The objective of every solver is ``F(w) = (1/N) sum_i loss_i(w) + (l2/2) ||w||^2`` with the regularizer
applied to *every* parameter on the parameter-server shards. scikit-learn does not penalize intercepts (and
MLP biases); :class:`FreeParams` wraps a model so that, summed over all ``N`` rows, its data term gives the
penalty of those parameters back exactly: each row adds ``-(l2/2) ||w_free||^2`` to its loss (and
``-l2 * w_free`` to its gradient). Summed over the portions of a Sandblaster batch, or averaged over a
Downpour mini-batch, that cancels the shards' ``(l2/2) ||w_free||^2`` term for any split of the rows.

Per-row weights (``sample_weight``, ``class_weight``) make the data term ``(1/N) sum_i s_i loss_i``, which is
scikit-learn's ``C * sum_i s_i loss_i + penalty`` divided by ``C N``. They reach the replicas, where the
gradient is computed, as one more column of the training rows: :func:`with_weights` appends it,
:class:`RowWeights` splits it off again and passes it to the model's
``loss_and_grad(w, X, y, sample_weight=...)`` (the built-in models have it). The weights are thus stored
with the rows, cut into the same portions, cached with them on the workers and read by the same code, so
neither the datasets nor the solvers know about them (Sandblaster and Downpour alike). Dask input (arrays or
a DataFrame, with weights as a Dask array or Series) gets the column on the workers before they write the
fit's dataset (:func:`dask_weights`, :func:`frame_weights`; ``"balanced"`` class counts are a reduction
there). A ``storage.Dataset`` given as it is cannot take the column (:func:`weighted_data` says what to do
instead), and weighted ``scipy.sparse`` rows are fitted with dense communication.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
from numpy.typing import ArrayLike, NDArray
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.models import Model
from distbelief.storage import Dataset
from distbelief.storage.internal import resolve_client, run_store

__all__ = [
    "PENALTIES",
    "SOLVERS",
    "FreeParams",
    "RowWeights",
    "WeightColumn",
    "fit_model",
    "row_weights",
    "with_weights",
]

SOLVERS = ("lbfgs", "cg", "gd", "downpour")
PENALTIES = ("l2", "l1", "elasticnet", None)

FloatArray = NDArray[np.float64]

#: The estimators log their fits here (INFO: start, every iteration with ``verbose``, end); a handler on
#: the ``distbelief`` logger sees them.
logger = logging.getLogger("distbelief.sklearn")


class _Wrapper:
    """What a model's wrapper (:class:`FreeParams`, :class:`RowWeights`) passes through as it is."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @property
    def n_params(self) -> int:
        """That of the wrapped model."""
        return int(self.model.n_params)

    @property
    def n_features(self) -> int:
        """That of the wrapped model."""
        return int(self.model.n_features)

    @property
    def n_classes(self) -> int | None:
        """That of the wrapped model."""
        k = getattr(self.model, "n_classes", None)
        return None if k is None else int(k)

    @property
    def label_kind(self) -> str:
        """That of the wrapped model."""
        return str(getattr(self.model, "label_kind", "real"))

    def init_params(self, seed: int | None = None) -> FloatArray:
        """That of the wrapped model."""
        return np.asarray(self.model.init_params(seed), dtype=np.float64)

    def check_labels(self, y: ArrayLike) -> None:
        """That of the wrapped model (if it has one)."""
        check = getattr(self.model, "check_labels", None)
        if callable(check):
            check(y)


class FreeParams(_Wrapper):
    """A model whose parameters in ``free`` are left out of the shards' L2 penalty (intercepts, biases).

    Parameters
    ----------
    model : Model
        The wrapped model; every other member is passed through.
    l2 : float
        The ``l2`` the solver applies on the shards.
    free : sequence of (start, stop)
        Ranges of ``w`` that must not be penalized.

    Examples
    --------
    >>> import numpy as np
    >>> from distbelief.models import LeastSquares, objective
    >>> m = FreeParams(LeastSquares(1), 0.5, [(1, 2)])
    >>> X, y, w = np.ones((4, 1)), np.zeros(4), np.array([1.0, 2.0])
    >>> objective(m, w, X, y, l2=0.5)[0] == objective(LeastSquares(1), w, X, y)[0] + 0.25 * 1.0
    True
    """

    def __init__(self, model: Any, l2: float, free: Sequence[tuple[int, int]]) -> None:
        super().__init__(model)
        self.l2 = float(l2)
        self.free = tuple((int(a), int(b)) for a, b in free)

    def loss_and_grad(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> tuple[float, FloatArray]:
        """The wrapped model's summed loss, minus ``(l2/2) ||w_free||^2`` per row, and its gradient."""
        loss, grad = self.model.loss_and_grad(w, X, y)
        grad = np.array(grad, dtype=np.float64)
        w_arr = np.asarray(w, dtype=np.float64)
        n = np.shape(X)[0]  # not len(X): the rows of a sparse dataset are a csr_array, whose len() raises
        for a, b in self.free:
            part = w_arr[a:b]
            loss -= n * 0.5 * self.l2 * float(part @ part)
            grad[a:b] -= n * self.l2 * part
        return float(loss), grad

    def compact(self, n_features: int, keys: NDArray[np.int64]) -> FreeParams:
        """This wrapper around the wrapped model narrowed to the parameters ``keys`` (the sparse path).

        A portion of sparse rows is computed by a model of the width of the columns it touches, whose
        parameters are ``w[keys]`` (``storage._keys.compact_model``); the free ranges move to where their
        keys sit in that vector. Every free parameter must be among ``keys`` (the intercepts always are),
        else the penalty of an untouched one would not be given back.

        Examples
        --------
        >>> from distbelief.models import Logistic
        >>> m = FreeParams(Logistic(1000), 0.5, [(1000, 1001)]).compact(2, np.array([3, 7, 1000]))
        >>> m.n_params, m.free
        (3, ((2, 3),))
        """
        from distbelief.storage.internal import compact_model

        inner = compact_model(self.model, n_features, keys)
        keys = np.asarray(keys, dtype=np.int64)
        # Parameters of the narrowed model before those of keys[0] have no key (a placeholder column).
        offset = int(inner.n_params) - keys.size
        free = []
        for a, b in self.free:
            lo, hi = (int(i) for i in np.searchsorted(keys, [a, b]))
            if hi - lo != b - a:
                raise InvalidOptionError(
                    f"FreeParams: the unpenalized parameters [{a}, {b}) are not all among a portion's keys"
                )
            free.append((lo + offset, hi + offset))
        return FreeParams(inner, self.l2, free)

    @property
    def spec(self) -> dict[str, Any] | None:
        """That of the wrapped model (so a result saved with ``to_zarr`` rebuilds it).

        It also makes the sparse path take this wrapper for the linear model it wraps
        (``storage._keys.sparse_layout_of``), which narrows it through :meth:`compact`.
        """
        spec = getattr(self.model, "spec", None)
        return spec if isinstance(spec, dict) else None

    def predict(self, w: ArrayLike, X: ArrayLike) -> NDArray[Any]:
        """That of the wrapped model."""
        return np.asarray(self.model.predict(w, X))

    def predict_proba(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        """That of the wrapped model."""
        return np.asarray(self.model.predict_proba(w, X), dtype=np.float64)

    def accuracy(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> float:
        """That of the wrapped model (Downpour's held-out evaluation)."""
        return float(self.model.accuracy(w, X, y))


class RowWeights(_Wrapper):
    """A model trained on rows whose last column is each row's weight (``sample_weight``, ``class_weight``).

    Its rows are ``[X, s]`` (made by :func:`with_weights`); ``loss_and_grad`` splits them into ``X`` and
    ``s`` and returns the wrapped model's ``sum_i s_i loss_i`` (``loss_and_grad(..., sample_weight=s)``) and
    its gradient. Any split of the rows into portions sums to the weighted loss of all of them.

    Parameters
    ----------
    model : Model
        A model whose ``loss_and_grad`` takes ``sample_weight`` (the linear models do).

    Examples
    --------
    >>> import numpy as np
    >>> from distbelief.models import LeastSquares
    >>> X, y, s = np.array([[1.0], [2.0]]), np.zeros(2), np.array([3.0, 0.0])
    >>> RowWeights(LeastSquares(1, fit_intercept=False)).loss_and_grad([1.0], with_weights(X, s), y)
    (1.5, array([3.]))
    """

    @property
    def n_features(self) -> int:
        """The wrapped model's features and the weight column."""
        return int(self.model.n_features) + 1

    @property
    def spec(self) -> None:
        """None: no built-in model takes the weight column (a saved result holds the parameters only)."""
        return None

    def loss_and_grad(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> tuple[float, FloatArray]:
        """The wrapped model's ``sum_i s_i loss_i`` over the rows ``X[:, :-1]`` with weights ``X[:, -1]``."""
        rows, weights = split_weights(X)
        loss, grad = self.model.loss_and_grad(w, rows, y, sample_weight=weights)
        return float(loss), np.asarray(grad, dtype=np.float64)

    def predict(self, w: ArrayLike, X: ArrayLike) -> NDArray[Any]:
        """That of the wrapped model, on ``X`` without the weight column."""
        return np.asarray(self.model.predict(w, split_weights(X)[0]))

    def accuracy(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> float:
        """That of the wrapped model, on ``X`` without the weight column."""
        return float(self.model.accuracy(w, split_weights(X)[0], y))


def split_weights(X: Any) -> tuple[Any, FloatArray]:
    """Rows made by :func:`with_weights`, split into the rows and the weights.

    Dense rows give a view (no copy: the products take the row stride of the narrower view as it is);
    CSR rows a copy without the last column, which costs about as much as one pass over the nonzeros.
    """
    if sp.issparse(X):
        csr = sp.csr_array(X)
        weights = np.asarray(csr[:, [csr.shape[1] - 1]].toarray(), dtype=np.float64).ravel()
        return csr[:, : csr.shape[1] - 1], weights
    rows = np.asarray(X, dtype=np.float64)
    return rows[:, :-1], rows[:, -1]


def with_weights(X: Any, weights: FloatArray) -> Any:
    """The rows ``X`` with ``weights`` as one more, last, column (what :class:`RowWeights` trains on).

    Dense rows give a C-contiguous float64 array, ``scipy.sparse`` rows a canonical ``csr_array`` (a zero
    weight is then not stored, as any zero).

    Examples
    --------
    >>> with_weights(np.zeros((2, 1)), np.array([1.0, 2.0]))
    array([[0., 1.],
           [0., 2.]])
    """
    if sp.issparse(X):
        out = sp.csr_array(sp.hstack([sp.csr_array(X), sp.csr_array(weights[:, None])], format="csr"))
        out.sum_duplicates()  # canonical (sorted indices), as the models' CSR rows must be
        return out
    return np.ascontiguousarray(np.column_stack([X, weights]), dtype=np.float64)


def check_sample_weight(sample_weight: object, n_rows: int, name: str) -> FloatArray | None:
    """``sample_weight`` as a float64 array of ``n_rows`` finite weights >= 0 (not all 0), or None.

    A number is every row's weight (as scikit-learn takes it).

    Raises
    ------
    InvalidOptionError
        Saying what is wrong and what to pass.

    Examples
    --------
    >>> check_sample_weight(2, 3, "est")
    array([2., 2., 2.])
    >>> check_sample_weight([1.0, -1.0], 2, "est")
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: est.fit: sample_weight must be >= 0, ...
    """
    if sample_weight is None:
        return None
    if sp.issparse(sample_weight) or is_dask_array(sample_weight):
        raise InvalidOptionError(
            f"{name}.fit: sample_weight must be a 1-D numpy array or list of numbers (one per row), got "
            f"{type(sample_weight).__name__}"
        )
    try:
        s = np.asarray(sample_weight, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(
            f"{name}.fit: sample_weight must hold numbers, one per row, got {type(sample_weight).__name__} "
            f"({exc})"
        ) from exc
    if s.ndim == 0:
        s = np.full(n_rows, float(s))
    if s.shape != (n_rows,):
        raise InvalidOptionError(
            f"{name}.fit: sample_weight must have shape ({n_rows},), one weight per row of X, got shape "
            f"{s.shape}"
        )
    if not np.all(np.isfinite(s)):
        at = int(np.flatnonzero(~np.isfinite(s))[0])
        raise InvalidOptionError(
            f"{name}.fit: sample_weight must be finite, got {s[at]} at row {at}; drop those rows or give "
            "them a weight"
        )
    if s.size and float(s.min()) < 0:
        at = int(np.argmin(s))
        raise InvalidOptionError(
            f"{name}.fit: sample_weight must be >= 0, got {s[at]} at row {at}; use 0 to leave a row out"
        )
    if not float(s.sum()) > 0:
        raise InvalidOptionError(
            f"{name}.fit: sample_weight is zero for every row, so there is nothing to fit; give some rows a "
            "weight > 0"
        )
    return s


def check_class_weight(class_weight: object, classes: NDArray[Any], name: str) -> None:
    """Check ``class_weight``: None, ``"balanced"`` or a dict ``{class label: weight >= 0}``.

    Raises
    ------
    InvalidOptionError
        For anything else, a key that is not a class of ``y`` (naming the classes), or a bad weight.
    """
    if class_weight is None or (isinstance(class_weight, str) and class_weight == "balanced"):
        return
    if not isinstance(class_weight, dict):
        raise InvalidOptionError(
            f"{name}: class_weight must be None, 'balanced' or a dict {{class label: weight}}, got "
            f"{class_weight!r}"
        )
    known = set(classes.tolist())
    unknown = [key for key in class_weight if key not in known]
    if unknown:
        raise InvalidOptionError(
            f"{name}: class_weight has keys {unknown!r} that are not classes of y; its keys must be among "
            f"the classes {sorted(known)!r} (a class left out gets weight 1)"
        )
    for key, value in class_weight.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(float(value))
            or float(value) < 0
        ):
            raise InvalidOptionError(
                f"{name}: class_weight[{key!r}] must be a finite number >= 0, got {value!r}"
            )


def row_weights(
    sample_weight: object,
    class_weight: object,
    classes: NDArray[Any] | None,
    y_index: FloatArray,
    name: str,
) -> FloatArray | None:
    """Every row's weight: ``sample_weight`` times its class's ``class_weight`` (scikit-learn's rule), or
    None when neither is given.

    ``y_index`` holds the rows' classes as indices into ``classes`` (None for a regressor); ``"balanced"``
    weights are scikit-learn's ``compute_class_weight`` (with ``sample_weight``, as
    ``LogisticRegression`` calls it).

    Examples
    --------
    >>> row_weights(None, {"b": 3.0}, np.array(["a", "b"]), np.array([0.0, 1.0, 1.0]), "est")
    array([1., 3., 3.])
    """
    n = int(y_index.shape[0])
    s = check_sample_weight(sample_weight, n, name)
    if class_weight is None or classes is None:
        return s
    from sklearn.utils.class_weight import compute_class_weight

    check_class_weight(class_weight, classes, name)
    labels = classes[y_index.astype(np.intp)]
    per_class = compute_class_weight(class_weight, classes=classes, y=labels, sample_weight=s)
    weights = np.asarray(per_class, dtype=np.float64)[y_index.astype(np.intp)]
    return weights if s is None else weights * s


class WeightColumn:
    """In place of the weights, for :func:`weighted_data`: the dataset's last column already holds every
    row's weight (written by the workers from Dask input, see :func:`dask_weights`)."""


def check_weight_stats(finite: bool, low: float, total: float, name: str) -> None:
    """The checks of :func:`check_sample_weight` from reductions over weights on the workers.

    Examples
    --------
    >>> check_weight_stats(True, -1.0, 3.0, "est")
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: est.fit: sample_weight must be >= 0, got -1.0; ...
    """
    if not finite:
        raise InvalidOptionError(
            f"{name}.fit: sample_weight must be finite, but it holds NaN, inf or a missing value; drop "
            "those rows or give them a weight"
        )
    if low < 0:
        raise InvalidOptionError(
            f"{name}.fit: sample_weight must be >= 0, got {low}; use 0 to leave a row out"
        )
    if not total > 0:
        raise InvalidOptionError(
            f"{name}.fit: sample_weight is zero for every row, so there is nothing to fit; give some rows a "
            "weight > 0"
        )


def class_weights(
    class_weight: object, classes: NDArray[Any] | None, counts: Callable[[], Any], name: str
) -> FloatArray | None:
    """Every class's weight (scikit-learn's ``compute_class_weight``), or None for no ``class_weight``.

    ``counts()`` gives the (sample-weighted) rows of every class, computed where the rows are; it is only
    called for ``"balanced"``: ``sum(counts) / (n_classes * counts)``.

    Examples
    --------
    >>> class_weights("balanced", np.array([0, 1]), lambda: [3.0, 1.0], "est")
    array([0.66666667, 2.        ])
    """
    if class_weight is None or classes is None:
        return None
    check_class_weight(class_weight, classes, name)
    if isinstance(class_weight, str):
        n = np.asarray(counts(), dtype=np.float64)
        return np.asarray(n.sum() / (len(classes) * n), dtype=np.float64)
    from sklearn.utils.class_weight import compute_class_weight

    return np.asarray(compute_class_weight(class_weight, classes=classes, y=classes), dtype=np.float64)


def _per_class(index: Any, weights: FloatArray) -> Any:
    """``weights`` of the class indices ``index`` (a numpy block or pandas Series; runs on a worker)."""
    if hasattr(index, "to_numpy"):
        import pandas as pd

        return pd.Series(weights[index.to_numpy().astype(np.intp)], index=index.index)
    return weights[np.asarray(index).astype(np.intp)]


def dask_weights(
    X: Any,
    y_index: Any,
    sample_weight: object,
    class_weight: object,
    classes: NDArray[Any] | None,
    client: Any,
    name: str,
) -> Any:
    """The Dask array ``X`` with every row's weight as one more, last, column, computed on the workers.

    ``y_index``: the rows' classes as indices into ``classes`` (a Dask array; None for a regressor).
    ``sample_weight`` is a Dask array or Series of one weight a row, a number, or a numpy array; only
    reductions (its checks, a ``"balanced"`` class count) come back to this process.
    """
    import dask.array as da

    n, rows = int(X.shape[0]), X.chunks[0]
    if is_dask_array(sample_weight) or is_dask_frame(sample_weight):
        if is_dask_frame(sample_weight):
            if getattr(sample_weight, "ndim", 1) != 1:
                raise InvalidOptionError(f"{name}.fit: sample_weight must be one weight a row (a Series)")
            series: Any = sample_weight
            sample_weight = series.to_dask_array(lengths=True)
        s = da.asarray(sample_weight)
        if s.ndim != 1 or s.shape[0] != n:
            raise InvalidOptionError(
                f"{name}.fit: sample_weight must have shape ({n},), one weight per row of X, got shape "
                f"{s.shape}"
            )
        if s.dtype.kind not in "biuf":
            raise InvalidOptionError(f"{name}.fit: sample_weight must hold numbers, got dtype {s.dtype}")
        s = s.astype(np.float64).rechunk((rows,))
        finite, low, total = client.compute([da.isfinite(s).all(), s.min(), s.sum()], sync=True)
        check_weight_stats(bool(finite), float(low), float(total), name)
    elif sample_weight is None:
        s = None
    else:
        s = da.from_array(check_sample_weight(sample_weight, n, name), chunks=(rows,))
    w = s if s is not None else da.ones(n, chunks=(rows,))
    if y_index is not None:
        y_index = y_index.rechunk((rows,))
        k = len(classes) if classes is not None else 0
        per_class = class_weights(
            class_weight,
            classes,
            lambda: client.compute(da.bincount(y_index.astype(np.int64), weights=s, minlength=k), sync=True),
            name,
        )
        if per_class is not None:
            w = w * y_index.map_blocks(_per_class, per_class, dtype=np.float64)
    return da.concatenate([X.astype(np.float64), w[:, None]], axis=1)


def frame_weights(
    frame: Any,
    label: str,
    sample_weight: object,
    class_weight: object,
    classes: NDArray[Any] | None,
    client: Any,
    name: str,
) -> tuple[Any, str]:
    """The Dask DataFrame ``frame`` (features and the label column ``label``, class indices for a
    classifier) with every row's weight as one more column, computed on the workers, and its name.

    ``sample_weight`` is a Dask Series aligned with the frame, or a number.
    """
    import dask.dataframe as dd
    import pandas as pd

    column = "__sample_weight__"
    while column in frame.columns:
        column += "_"
    if isinstance(sample_weight, dd.Series):
        if not pd.api.types.is_numeric_dtype(sample_weight.dtype) or pd.api.types.is_bool_dtype(
            sample_weight.dtype
        ):
            raise InvalidOptionError(
                f"{name}.fit: sample_weight must hold numbers, got dtype {sample_weight.dtype}"
            )
        missing, low, high, total = client.compute(
            [sample_weight.isna().sum(), sample_weight.min(), sample_weight.max(), sample_weight.sum()],
            sync=True,
        )
        finite = int(missing) == 0 and math.isfinite(float(low)) and math.isfinite(float(high))
        check_weight_stats(finite, float(low), float(total), name)
        frame = frame.assign(**{column: sample_weight.astype(np.float64)})
    elif sample_weight is None or (
        isinstance(sample_weight, numbers.Real) and not isinstance(sample_weight, bool)
    ):
        checked = check_sample_weight(sample_weight, 1, name)
        value = 1.0 if checked is None else float(checked[0])
        frame = frame.assign(**{column: value})
    else:
        raise InvalidOptionError(
            f"{name}.fit: with a Dask DataFrame X, sample_weight must be a Dask Series aligned with it (e.g. "
            f"df['weight']) or a number, got {type(sample_weight).__name__}"
        )
    if classes is not None:
        per_class = class_weights(
            class_weight,
            classes,
            lambda: (
                client.compute(frame.groupby(label)[column].sum(), sync=True)
                .reindex(np.arange(len(classes), dtype=np.float64), fill_value=0.0)
                .to_numpy()
            ),
            name,
        )
        if per_class is not None:
            scale = frame[label].map_partitions(_per_class, per_class, meta=(column, np.float64))
            frame = frame.assign(**{column: frame[column] * scale})
    return frame, column


def weighted_data(
    data: Any,
    weights: FloatArray | WeightColumn | None,
    name: str,
    *,
    downpour_options: dict[str, Any] | None = None,
) -> tuple[Any, Callable[[Any], Any]]:
    """The training data with the weight column (if any), and the wrapper the model needs for it.

    Weighted ``scipy.sparse`` rows are fitted with dense communication (whole parameter vectors pulled and
    pushed, as for an MLP): the sparse pull/push path finds the parameters a row touches from its columns,
    and the weight column is not one of them.

    Raises
    ------
    InvalidOptionError
        For weighted rows that cannot carry the column: a ``storage.Dataset`` (also one made from Dask
        arrays), or Downpour's held-out ``eval_data`` (its rows have no weight column); the message says
        what to do instead.
    """
    if weights is None:
        return data, lambda model: model
    what = "sample_weight / class_weight"
    if (downpour_options or {}).get("eval_data") is not None:
        raise InvalidOptionError(
            f"{name}.fit: {what} cannot be used with downpour_options['eval_data'] (the held-out rows "
            "would be read as weighted ones); drop eval_data and score the fitted estimator on them instead"
        )
    if isinstance(weights, WeightColumn):
        return data, RowWeights
    if not isinstance(data, tuple):
        raise InvalidOptionError(
            f"{name}.fit: {what} need the rows in memory (numpy, pandas or scipy.sparse); a "
            "storage.Dataset, Dask arrays or a Dask DataFrame cannot carry per-row weights. Fit arrays "
            "(X.compute(), y.compute()), or for integer weights repeat the rows in the dataset"
        )
    X, y = data
    return (with_weights(X, weights), y), RowWeights


def check_verbose(verbose: object, name: str) -> int:
    """``verbose`` as an int >= 0 (a bool counts as 0/1)."""
    if not isinstance(verbose, numbers.Integral) or int(verbose) < 0:
        raise InvalidOptionError(
            f"{name}: verbose must be an int >= 0 (0: quiet, 1: a progress bar and INFO logs), got "
            f"{verbose!r}"
        )
    return int(verbose)


def check_callback(callback: object, name: str) -> None:
    """``callback`` must be None or callable (with one argument, an iteration record)."""
    if callback is not None and not callable(callback):
        raise InvalidOptionError(
            f"{name}: callback must be None or a function of one argument (sandblaster.IterationRecord, or "
            f"downpour.Progress for solver='downpour'), got {callback!r}"
        )


# ------------------------------------------------------------------------------------------- clusters


def clone_keeping_client(estimator: Any) -> Any:
    """``sklearn.base.clone`` for an estimator whose ``client`` may be a live ``distributed.Client``.

    A client is a connection, not state: clones share it (``copy.deepcopy`` of a client fails).
    """
    params = estimator.get_params(deep=False)
    client = params.pop("client", None)
    new_params = {name: clone(value, safe=False) for name, value in params.items()}
    return type(estimator)(client=client, **new_params)


def picklable_state(state: dict[str, Any]) -> dict[str, Any]:
    """The ``__dict__`` of an estimator without a live ``distributed.Client``: it becomes ``None``.

    A client is a connection to a cluster that may be gone when the estimator is loaded (a refit would
    wait for its scheduler, then fail): the loaded estimator predicts as before, and a refit runs on the
    default client or the embedded cluster, or where ``set_params(client=...)`` says. A scheduler address
    the user gave (a ``str``) is kept: it is their setting.
    """
    client = state.get("client")
    if client is not None and not isinstance(client, str):
        state = dict(state)
        state["client"] = None
    return state


# -------------------------------------------------------------------------------------------- fitting


@contextlib.contextmanager
def fit_store(store: str | os.PathLike[str] | None) -> Iterator[str]:
    """``store`` itself, or a temporary directory deleted after the fit: made only if the fit writes to it
    (a fit in this process never does)."""
    with run_store(store, "distbelief-fit-", lazy=True) as root:
        yield root


def check_common(solver: object, penalty: object, max_iter: object, tol: object, name: str) -> None:
    """Check the options every estimator has; raise :class:`InvalidOptionError` saying what to pass."""
    if penalty not in PENALTIES:
        raise InvalidOptionError(f"{name}: penalty must be one of {PENALTIES}, got {penalty!r}")
    if solver not in SOLVERS:
        raise InvalidOptionError(f"{name}: solver must be one of {SOLVERS}, got {solver!r}")
    if penalty in ("l1", "elasticnet") and solver != "lbfgs":
        raise InvalidOptionError(
            f"{name}: penalty={penalty!r} is minimized by OWL-QN (L-BFGS for an L1 term): use "
            f"solver='lbfgs', got solver={solver!r}"
        )
    # numbers.Integral / numbers.Real take numpy's scalars too (np.int32(5), np.float32(1e-4)), as
    # scikit-learn's parameter checks do; a bool is an Integral, but never a count or a tolerance.
    if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral) or max_iter < 1:
        raise InvalidOptionError(f"{name}: max_iter must be an int >= 1, got {max_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not float(tol) >= 0:
        raise InvalidOptionError(f"{name}: tol must be a number >= 0, got {tol!r}")


def check_alpha(alpha: object, name: str) -> None:
    """Check an L2 strength ``alpha`` (>= 0) as scikit-learn means it."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not float(alpha) >= 0:
        raise InvalidOptionError(f"{name}: alpha must be a number >= 0, got {alpha!r}")


#: Seconds a fit runs before its progress bar appears (tqdm's ``delay``): short fits print nothing.
PROGRESS_DELAY = 2.0


class FitProgress:
    """The callback a fit gives its solver: a tqdm bar showing the objective (with ``verbose``), a log line
    per iteration on :data:`logger`, then the user's ``callback``.

    The bar counts iterations (Sandblaster's ``IterationRecord.iteration``) or epochs (Downpour's
    ``Progress.epoch``) up to ``total``, and appears only once the fit has run :data:`PROGRESS_DELAY`
    seconds. The log lines are INFO with ``verbose``, else DEBUG. Use it as a context manager: the bar is
    closed on the way out.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> seen = []
    >>> with FitProgress("est", verbose=0, callback=seen.append, total=10) as report:
    ...     report(SimpleNamespace(iteration=1, objective=0.5, grad_norm=0.1))
    >>> seen[0].objective
    0.5
    """

    def __init__(
        self, name: str, *, verbose: int, callback: Callable[[Any], None] | None, total: int
    ) -> None:
        from tqdm.auto import tqdm

        self.name = name
        self.level = logging.INFO if verbose else logging.DEBUG
        self.callback = callback
        self.bar = tqdm(
            total=total, desc=name, unit="it", delay=PROGRESS_DELAY, disable=not verbose, leave=True
        )

    def __enter__(self) -> FitProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def __call__(self, record: Any) -> None:
        objective = float(record.objective)
        iterations = hasattr(record, "iteration")  # sandblaster.IterationRecord, else downpour.Progress
        done: float = int(record.iteration) if iterations else float(record.epoch)
        # Nothing is formatted for a quiet bar or a log line nobody sees: a small fit calls this ~30 times.
        if not self.bar.disable:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix(objective=f"{objective:.8g}", refresh=False)
        if logger.isEnabledFor(self.level):
            if iterations:
                where, extra = f"iteration {done}", f", max|grad| {float(record.grad_norm):.3g}"
            else:
                where, extra = f"epoch {done:.2f}", ""
            logger.log(self.level, "%s: %s, objective %.10g%s", self.name, where, objective, extra)
        if self.callback is not None:
            self.callback(record)


def fit_model(
    model: Model,
    data: Dataset | tuple[FloatArray, FloatArray],
    *,
    l2: float,
    free: Sequence[tuple[int, int]],
    solver: str,
    l1: float = 0.0,
    max_iter: int,
    tol: float,
    client: Any,
    store: str,
    x0: FloatArray | None = None,
    seed: int = 0,
    downpour_options: dict[str, Any] | None = None,
    name: str = "estimator",
    verbose: int = 0,
    callback: Callable[[Any], None] | None = None,
) -> tuple[FloatArray, int, Any]:
    """Minimize ``F`` with the chosen solver; return the parameters, the iterations and the run's result.

    ``F(w) = (1/N) sum_i loss_i(w) + l1 ||w||_1 + (l2/2) ||w||^2`` with neither term on the ``free``
    ranges: the L2 term is given back by :class:`FreeParams`, the L1 term leaves them out on the shards
    (``minimize(l1_exclude=...)``). ``l1 > 0`` runs OWL-QN (``solver`` must be ``"lbfgs"``).
    Iterations are Sandblaster's ``nit``, or Downpour's epochs run (``max_iter`` epochs per replica).
    A run that stops at ``max_iter`` warns with scikit-learn's ``ConvergenceWarning``. ``callback`` is
    the solver's (``minimize``'s or ``downpour.train``'s), called through :class:`FitProgress`, which shows
    a progress bar with ``verbose``; the fit's start and end are logged at INFO on :data:`logger`.
    """
    run_model = FreeParams(model, l2, free) if (l2 > 0 and free) else model
    # Small rows in memory and no client: the method runs in this process (no cluster is even started).
    local = client is None and solver != "downpour" and fits_in_process(data, run_model)
    c = None if local else resolve_client(client)
    if l1 > 0 and solver != "lbfgs":
        raise InvalidOptionError(f"{name}: an L1 term needs solver='lbfgs' (OWL-QN), got {solver!r}")
    rows = data.n_rows if isinstance(data, Dataset) else np.shape(data[0])[0]
    where = "in this process" if local else "on the cluster"
    logger.info("%s: fitting %d rows with solver=%r, max_iter=%d, %s", name, rows, solver, max_iter, where)
    started = time.perf_counter()
    with FitProgress(name, verbose=verbose, callback=callback, total=max_iter) as report:
        if solver == "downpour":
            from distbelief.downpour import train

            result: Any = train(
                run_model, data, l2=l2, epochs=max_iter, client=c, store=os.path.join(store, "run"), x0=x0,
                seed=seed, callback=report, **(downpour_options or {}),
            )  # fmt: skip
            if not result.success:
                raise DatasetError(f"{name}: Downpour stopped early ({result.message})")
            nit = int(max_iter)
        else:
            from distbelief.sandblaster import minimize

            run_on: dict[str, Any] = (
                {"local": True} if c is None else {"client": c, "store": os.path.join(store, "run")}
            )
            result = minimize(
                run_model, data, method="owlqn" if l1 > 0 else solver,  # type: ignore[arg-type]
                x0=x0, l2=l2, l1=l1, l1_exclude=free if l1 > 0 else (), gtol=tol,
                ftol=64 * np.finfo(float).eps,  # scikit-learn's lbfgs setting
                maxiter=max_iter, seed=seed, callback=report, **run_on,
            )  # fmt: skip
            if result.status == 1:
                warnings.warn(
                    f"{name}: {solver} did not converge in max_iter={max_iter} iterations "
                    f"({result.message}); increase max_iter or scale the data",
                    ConvergenceWarning,
                    stacklevel=4,  # the estimator's fit
                )
            nit = int(result.nit)
    logger.info(
        "%s: %s stopped after %d iterations in %.2f s: %s",
        name, solver, nit, time.perf_counter() - started, getattr(result, "message", ""),
    )  # fmt: skip
    return np.asarray(result.x, dtype=np.float64), nit, result


#: Rows in memory whose gradient takes at most about this many multiply-adds (nonzeros of ``X`` times the
#: model's parameters per feature: ~10-20 ms on one core) are fitted in this process when no client is given:
#: a cluster's round trips (an actor call ~1.7 ms, a task ~11 ms) would cost more than they save.
LOCAL_MAX_WORK = 2e7
#: ... and whose model has fewer parameters than this: a wider one's vector ops go faster on the shards
#: (Sandblaster's own rule for one shard against several, ``sandblaster._minimize.SHARD_MIN_PARAMS``).
LOCAL_MAX_PARAMS = 1 << 17


def fits_in_process(data: Any, model: Model) -> bool:
    """Whether ``data`` is rows in memory small enough to fit ``model`` in this process (see
    :data:`LOCAL_MAX_WORK` and :data:`LOCAL_MAX_PARAMS`).

    Examples
    --------
    >>> from distbelief import models
    >>> fits_in_process((np.zeros((500, 30)), np.zeros(500)), models.Logistic(30))
    True
    >>> fits_in_process((np.zeros((10**6, 100)), np.zeros(10**6)), models.Logistic(100))
    False
    """
    if not isinstance(data, tuple) or len(data) != 2 or model.n_params >= LOCAL_MAX_PARAMS:
        return False
    X = data[0]
    if not (isinstance(X, np.ndarray) or sp.issparse(X)) or X.ndim != 2:
        return False
    entries = X.nnz if sp.issparse(X) else X.shape[0] * X.shape[1]
    return bool(entries * model.n_params / max(1, X.shape[1]) <= LOCAL_MAX_WORK)


def is_dask_array(X: object) -> bool:
    """Whether ``X`` is a Dask array (without importing dask.array unless it is loaded)."""
    import sys

    da = sys.modules.get("dask.array")
    return da is not None and isinstance(X, da.Array)


def is_dask_frame(X: object) -> bool:
    """Whether ``X`` is a Dask DataFrame or Series (without importing dask.dataframe unless it is loaded)."""
    import sys

    dd = sys.modules.get("dask.dataframe")
    return dd is not None and isinstance(X, dd.DataFrame | dd.Series)


def names_of(X: Any) -> Any:
    """What scikit-learn's feature-name checks should look at for ``X``: ``X`` itself, or for a Dask
    DataFrame an empty pandas DataFrame with its columns (scikit-learn does not recognize Dask's lazy
    frames, and the names need no data).

    Examples
    --------
    >>> names_of(np.zeros(2)).shape
    (2,)
    """
    if is_dask_frame(X) and hasattr(X, "columns"):
        import pandas as pd

        return pd.DataFrame(columns=X.columns)
    return X


def frame_as_array(X: Any, name: str) -> Any:
    """The Dask DataFrame ``X`` as a lazy float64 Dask array (bool columns as 0/1), or an error naming a
    column that is not numbers.

    Raises
    ------
    DatasetError
        For a string, categorical or other non-number column, saying how to encode it.
    """
    import pandas as pd

    cols = {}
    for col, dt in X.dtypes.items():
        if pd.api.types.is_bool_dtype(dt):
            cols[col] = np.float64
        elif not pd.api.types.is_numeric_dtype(dt) or pd.api.types.is_complex_dtype(dt):
            raise DatasetError(
                f"{name}: column {col!r} of X holds {dt} values, not numbers; encode it on the workers with "
                "Dataset.from_dask(X, y, path=..., categorical='onehot') (few distinct values) or "
                "hash_features=2**20 (many) and fit that dataset, or drop the column "
                f"(X.drop(columns=[{col!r}]))"
            )
    X = X.astype(cols) if cols else X
    return X.to_dask_array().astype(np.float64)


def map_rows(X: Any, fn: Callable[[FloatArray], NDArray[Any]], out_cols: int | None, dtype: Any) -> Any:
    """``fn`` applied to every row block of the Dask array ``X`` on the workers (a lazy Dask array)."""
    X = X.rechunk({1: -1})
    if out_cols is None:
        return X.map_blocks(fn, drop_axis=1, dtype=dtype)
    return X.map_blocks(fn, chunks=(X.chunks[0], (out_cols,)), dtype=dtype)
