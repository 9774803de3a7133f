"""Input checks shared by the built-in models.

The checks on the hot path (:func:`as_params`, :func:`as_rows`, :func:`as_targets`) only look at shapes and
dtypes, which costs O(1): scanning the rows of ``X`` for NaN would cost as much memory traffic as the
gradient itself. Datasets are checked for finite values once, when they are stored; if a loss nevertheless
comes out non-finite, :func:`diagnose_nonfinite` finds out why (and only then pays for a scan).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from distbelief.errors import DatasetError, InvalidOptionError

__all__ = [
    "LabelKind",
    "as_csr",
    "as_params",
    "as_rows",
    "as_targets",
    "as_weights",
    "binary_labels",
    "class_labels",
    "diagnose_nonfinite",
    "is_sparse",
    "real_labels",
]

LabelKind = Literal["real", "binary", "classes"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.intp]


def as_params(w: ArrayLike, n_params: int, model: str) -> FloatArray:
    """Return ``w`` as a float64 vector of length ``n_params`` (no copy when it already is one)."""
    arr = np.asarray(w, dtype=np.float64)
    if arr.shape != (n_params,):
        raise InvalidOptionError(
            f"parameter vector for {model} must have shape ({n_params},), got shape {arr.shape}; "
            "build it with model.init_params() or check that it belongs to this model"
        )
    # O(n_params), against O(n_rows * n_params) for the gradient: cheap, and a saturating activation
    # could otherwise hide an infinite weight behind a finite loss.
    if not np.isfinite(arr).all():
        raise InvalidOptionError(
            f"the parameter vector given to {model} contains NaN or inf; the optimizer has diverged "
            "(lower the learning rate / step size, or restart from model.init_params())"
        )
    return arr


def is_sparse(X: object) -> bool:
    """Whether ``X`` is a ``scipy.sparse`` matrix or array (checked by module: no scipy import here)."""
    return type(X).__module__.startswith("scipy.sparse")


def as_csr(X: Any, n_features: int, model: str) -> Any:
    """Return sparse ``X`` as CSR with float64 data and ``n_features`` columns (no copy of such input).

    Indices may be int32 or int64, sorted or not; duplicates add up (as in scipy's own products).
    """
    if X.ndim != 2 or X.shape[1] != n_features:
        raise DatasetError(
            f"{model} expects rows X of shape (n_rows, {n_features}), got a sparse matrix of shape "
            f"{X.shape}; pass a 2-D matrix with one row per example"
        )
    if X.format != "csr":
        X = X.tocsr()  # a copy, as any other format must be converted for row-wise passes
    if X.dtype != np.float64:
        if X.dtype.kind not in "biuf":
            raise DatasetError(f"{model} expects real-valued rows X, got a sparse matrix of dtype {X.dtype}")
        X = X.astype(np.float64)
    if X.indptr.dtype != X.indices.dtype:  # scipy keeps them alike, but a hand-built matrix may not
        X = X.copy()
        X.indptr = X.indptr.astype(X.indices.dtype)
    # The compiled passes do not check bounds, and scipy only checks indices on request: one O(nnz) look
    # (a few % of a pass) instead of a wrong result or a crash. Viewed unsigned, a negative index is huge.
    nnz = int(X.indptr[-1])
    if nnz:
        unsigned = X.indices[:nnz].view(np.uint32 if X.indices.dtype.itemsize == 4 else np.uint64)
        if int(unsigned.max()) >= n_features:
            raise DatasetError(
                f"{model} got sparse rows X with a column index outside 0..{n_features - 1}; the matrix is "
                "malformed: rebuild it (e.g. scipy.sparse.csr_array((data, (rows, cols)), shape=...))"
            )
    return X


def as_rows(X: ArrayLike, n_features: int, model: str) -> FloatArray:
    """Return ``X`` as a 2-D float64 array with ``n_features`` columns, without copying float64 input."""
    if is_sparse(X):
        raise DatasetError(
            f"{model} takes dense rows X, got a scipy.sparse matrix; densify it (X.toarray(), or rebuild the "
            "dataset from a dense array), or use a linear model (LeastSquares, Logistic, Softmax), which "
            "take sparse rows"
        )
    arr = np.asarray(X, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != n_features:
        raise DatasetError(
            f"{model} expects rows X of shape (n_rows, {n_features}), got shape {arr.shape}; "
            "pass a 2-D array with one row per example"
        )
    return arr


def as_targets(y: ArrayLike, n_rows: int, model: str) -> NDArray[np.generic]:
    """Return ``y`` as a 1-D array with ``n_rows`` entries (dtype unchanged)."""
    arr = np.asarray(y)
    if arr.shape != (n_rows,):
        raise DatasetError(
            f"{model} expects labels y of shape ({n_rows},) to match the {n_rows} rows of X, "
            f"got shape {arr.shape}; pass one label per row"
        )
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise DatasetError(f"{model} expects numeric labels, got an array of dtype {arr.dtype}")
    return arr


def as_weights(sample_weight: ArrayLike, n_rows: int, model: str) -> FloatArray:
    """Return per-row weights as a 1-D float64 array of ``n_rows`` finite numbers >= 0."""
    arr = np.asarray(sample_weight, dtype=np.float64)
    if arr.shape != (n_rows,):
        raise DatasetError(
            f"{model} expects sample_weight of shape ({n_rows},) to match the {n_rows} rows of X, "
            f"got shape {arr.shape}; pass one weight per row"
        )
    if not np.all(np.isfinite(arr)) or (arr.size and float(arr.min()) < 0):
        raise DatasetError(f"{model} expects finite sample weights >= 0; drop or fix the bad ones")
    return arr


def _first_bad(bad: NDArray[np.bool_], y: NDArray[np.generic]) -> str:
    idx = int(np.flatnonzero(bad)[0])
    return f"{int(np.count_nonzero(bad))} bad label(s), the first {y[idx].item()!r} at row {idx}"


def real_labels(y: NDArray[np.generic], model: str) -> FloatArray:
    """Check real-valued targets (finite numbers) and return them as float64."""
    out = np.asarray(y, dtype=np.float64)
    bad = ~np.isfinite(out)
    if bad.any():
        raise DatasetError(
            f"{model} expects finite real-valued targets; found {_first_bad(bad, y)}. "
            "Drop or impute the rows with NaN/inf targets"
        )
    return out


def binary_labels(y: NDArray[np.generic], model: str) -> FloatArray:
    """Check 0/1 labels and return them as float64 (no copy for float64 input)."""
    out = np.asarray(y, dtype=np.float64)
    bad = (out != 0.0) & (out != 1.0)
    if bad.any():
        raise DatasetError(
            f"{model} expects binary labels 0 or 1; found {_first_bad(bad, y)}. "
            "Map the classes to 0/1 first (e.g. y = (y == positive_class)), or use a softmax model "
            "for more than two classes"
        )
    return out


def class_labels(y: NDArray[np.generic], n_classes: int, model: str) -> IntArray:
    """Check integral labels in ``0..n_classes-1`` and return them as an index array."""
    if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        idx = y.astype(np.intp, copy=False)
        non_integral = False
    else:
        with np.errstate(invalid="ignore"):  # NaN/inf: caught just below as non-integral
            idx = y.astype(np.intp)
        non_integral = bool((idx != y).any())
    if idx.size and (non_integral or int(idx.min()) < 0 or int(idx.max()) >= n_classes):
        # Only on failure: build the full mask, to say where the first bad label is.
        bad = (idx != y) | (idx < 0) | (idx >= n_classes)
        raise DatasetError(
            f"{model} expects integer class labels 0..{n_classes - 1} (n_classes={n_classes}); "
            f"found {_first_bad(bad, y)}. Encode the classes as 0..{n_classes - 1} "
            "(e.g. np.unique(y, return_inverse=True)) or build the model with more classes"
        )
    return idx


def diagnose_nonfinite(loss: float, X: Any, y: NDArray[np.generic], model: str) -> float:
    """Explain a non-finite loss, or return it unchanged when it is a genuine overflow.

    The parameters were already checked by :func:`as_params`. ``X`` is dense or CSR.

    Only called when the loss is NaN or inf, so the full scans here cost nothing on the normal path.
    """
    if is_sparse(X):
        bad = ~np.isfinite(X.data[: X.indptr[-1]])
        if bad.any():
            bad_row = int(np.searchsorted(X.indptr, np.flatnonzero(bad)[0], side="right")) - 1
            raise DatasetError(
                f"the rows X given to {model} contain NaN or inf (first at row {bad_row}); "
                "clean or drop those rows before training"
            )
    elif not np.isfinite(X).all():
        bad_row = int(np.flatnonzero(~np.isfinite(X).all(axis=1))[0])
        raise DatasetError(
            f"the rows X given to {model} contain NaN or inf (first at row {bad_row}); "
            "clean or drop those rows before training"
        )
    if np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all():
        bad_row = int(np.flatnonzero(~np.isfinite(y))[0])
        raise DatasetError(
            f"the targets y given to {model} contain NaN or inf (first at row {bad_row}); "
            "clean or drop those rows before training"
        )
    return loss
