"""Validation of a dataset's inputs (X, labels, options) and its default layout (chunk and portion rows).

Part of :mod:`storage._dataset` (split by concern: metadata, location, validation, readers, the class).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from distbelief.errors import DatasetError, InvalidOptionError

from ._dataset_meta import _LABEL_KINDS, FloatArray, LabelKind

_TARGET_PORTIONS = 64
_MIN_PORTION_ROWS = 1024
_MAX_PORTION_BYTES = 8 * 2**20
_CHUNKS_PER_PORTION = 4
# Validation and writing walk X in blocks of about this size, so a dtype conversion never copies all of X.
_BLOCK_BYTES = 64 * 2**20


# ------------------------------------------------------------------------------------------ validation


def _check_int(value: object, what: str, *, minimum: int = 1, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < minimum:
        raise InvalidOptionError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _as_matrix(X: object) -> np.ndarray[Any, Any]:
    """``X`` as a 2-D numeric ndarray (any real dtype; converted to float64 block by block later)."""
    try:
        arr = np.asarray(X)
    except (TypeError, ValueError) as exc:
        raise DatasetError(
            f"X cannot be read as a numeric array ({exc}); pass a 2-D array of numbers"
        ) from exc
    if arr.ndim != 2:
        hint = " (for a single feature use X.reshape(-1, 1))" if arr.ndim == 1 else ""
        raise DatasetError(f"X must be 2-D (rows x features); got shape {arr.shape}{hint}")
    arr = _numeric(arr, "X", "values")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise DatasetError(
            f"X is empty (shape {arr.shape}); a dataset needs at least one row and one feature"
        )
    return arr


def _numeric(arr: np.ndarray[Any, Any], what: str, noun: str) -> np.ndarray[Any, Any]:
    if arr.dtype.kind in "biuf":
        return arr
    if arr.dtype.kind == "c":
        raise DatasetError(f"{what} holds complex numbers; {noun} must be real numbers")
    if arr.dtype.kind == "O":
        try:
            return arr.astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise DatasetError(
                f"{what} holds {noun} that are not numbers ({exc}); convert them first"
            ) from exc
    hint = (
        "; encode class labels as integers 0..K-1 first, e.g. with numpy.unique(y, return_inverse=True)"
        if what == "y"
        else "; convert them to numbers first"
    )
    raise DatasetError(f"{what} must hold numbers, got dtype {arr.dtype}{hint}")


def _as_labels(y: object, n_rows: int) -> FloatArray:
    try:
        arr = np.asarray(y)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"y cannot be read as an array of labels ({exc})") from exc
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise DatasetError(f"y must be 1-D (one label per row); got shape {arr.shape}")
    arr = _numeric(arr, "y", "labels")
    if arr.shape[0] != n_rows:
        raise DatasetError(
            f"X has {n_rows} rows but y has {arr.shape[0]} labels; give exactly one label per row"
        )
    out = np.ascontiguousarray(arr, dtype=np.float64)
    bad = ~np.isfinite(out)
    if bad.any():
        idx = np.flatnonzero(bad)
        raise DatasetError(
            f"y has {idx.size} non-finite labels (NaN or inf), the first at row {idx[0]}; "
            "every label must be a finite number: drop or fix those rows"
        )
    return out


def _block_rows(n_features: int, chunk_rows: int) -> int:
    rows = max(1, _BLOCK_BYTES // (8 * n_features))
    return max(chunk_rows, rows - rows % chunk_rows)


def _check_finite(X: np.ndarray[Any, Any], block: int) -> None:
    if X.dtype.kind in "biu":
        return
    n = X.shape[0]
    for r0 in range(0, n, block):
        part = X[r0 : r0 + block]
        # A sum is finite exactly when no value is NaN/inf, unless finite values overflow: then look closer.
        # Summing needs no temporary, unlike isfinite, so the common (clean) case costs one pass.
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.sum(part, dtype=np.float64)
        if np.isfinite(total):
            continue
        bad = ~np.isfinite(np.asarray(part, dtype=np.float64))
        if not bad.any():
            continue
        first = np.argwhere(bad)[0]
        count = int(bad.sum())
        for r1 in range(r0 + block, n, block):
            count += int((~np.isfinite(np.asarray(X[r1 : r1 + block], dtype=np.float64))).sum())
        raise DatasetError(
            f"X has {count} non-finite values (NaN or inf), the first at row {r0 + first[0]}, column "
            f"{first[1]}; remove or impute them before building a dataset"
        )


def _detect_labels(y: FloatArray, label_kind: object, n_classes: object) -> tuple[LabelKind, int | None]:
    if label_kind is not None and label_kind not in _LABEL_KINDS:
        raise InvalidOptionError(f"label_kind must be one of {_LABEL_KINDS} or None, got {label_kind!r}")
    k_opt = _check_int(n_classes, "n_classes", minimum=2)
    if k_opt is not None:
        if label_kind is None:
            label_kind = "classes"
        elif label_kind == "real":
            raise InvalidOptionError("n_classes does not apply to label_kind='real'; drop it")
        elif label_kind == "binary" and k_opt != 2:
            raise InvalidOptionError(f"label_kind='binary' means n_classes=2, got n_classes={k_opt}")
    is01 = (y == 0.0) | (y == 1.0)
    isint = y == np.floor(y)
    if label_kind is None:
        if is01.all():
            return "binary", 2
        if isint.all() and y.min() >= 0:
            k = int(y.max()) + 1
            # Integers are classes only when every class 0..K-1 occurs: integer-valued regression targets
            # (counts, ratings starting at 1) stay real. Pass label_kind="classes" to override.
            if k > 2 and np.unique(y).size == k:
                return "classes", k
        return "real", None
    if label_kind == "real":
        return "real", None
    if label_kind == "binary":
        if not is01.all():
            i = int(np.flatnonzero(~is01)[0])
            raise DatasetError(
                f"label_kind='binary' needs every label to be 0 or 1, but row {i} has {y[i]!r}; "
                "map the labels first (for -1/+1 labels use (y + 1) / 2)"
            )
        return "binary", 2
    ok = isint & (y >= 0)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise DatasetError(
            f"label_kind='classes' needs integer labels 0..K-1, but row {i} has {y[i]!r}; "
            "encode the classes first, e.g. with numpy.unique(y, return_inverse=True)"
        )
    k = max(2, int(y.max()) + 1)
    if k_opt is not None:
        if k > k_opt:
            raise DatasetError(
                f"labels go up to {k - 1} ({k} classes) but n_classes={k_opt}; pass n_classes>={k}"
            )
        k = k_opt
    return "classes", k


def _layout(n_rows: int, n_features: int, portion_rows: object, chunk_rows: object) -> tuple[int, int]:
    """Return ``(chunk_rows, portion_rows)``; see the module docstring for the defaults."""
    p = _check_int(portion_rows, "portion_rows")
    c = _check_int(chunk_rows, "chunk_rows")
    if p is None:
        auto = max(_MIN_PORTION_ROWS, math.ceil(n_rows / _TARGET_PORTIONS))
        auto = max(1, min(auto, _MAX_PORTION_BYTES // (8 * n_features)))
        if c is None:
            c = max(1, auto // _CHUNKS_PER_PORTION)
        # Round down to whole chunks, so the byte cap holds (unless a single chunk already exceeds it).
        p = c * max(1, auto // c)
    elif c is None:
        c = p
    c = min(c, n_rows)
    p = min(p, n_rows)
    _check_portion_rows(p, c, n_rows)
    return c, p


def _check_portion_rows(p: int, c: int, n_rows: int) -> None:
    if p % c != 0 and p != n_rows:
        raise InvalidOptionError(
            f"portion_rows={p} is not a multiple of the dataset's chunk_rows={c}; a portion must be whole "
            f"chunks: use a multiple of {c}"
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
