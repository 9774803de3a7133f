"""scikit-learn's handwritten digits as a small, offline dataset for demos, tests and held-out evaluation.

The data (1,797 images of 8 x 8 pixels, 10 classes) ships inside scikit-learn, so nothing is downloaded.
Pixel values (integers 0..16) are divided by 16, so every feature lies in [0, 1].
"""

from __future__ import annotations

import os
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from distbelief.errors import InvalidOptionError

from ._dataset import Dataset

__all__ = ["N_CLASSES", "N_FEATURES", "N_ROWS", "digits_dataset", "load_digits", "train_test_split_digits"]

FloatArray = npt.NDArray[np.float64]

N_ROWS = 1797
N_FEATURES = 64
N_CLASSES = 10


def load_digits(*, binary_digit: int | None = None) -> tuple[FloatArray, FloatArray]:
    """The digits data as float64 arrays, in scikit-learn's row order.

    Parameters
    ----------
    binary_digit : int, optional
        If given (0..9), labels are 1.0 for that digit and 0.0 for every other ("one vs rest", for a binary
        logistic model). Default: the digit itself, 0.0..9.0.

    Returns
    -------
    X : ndarray, shape (1797, 64)
        Pixel intensities scaled to [0, 1] (scikit-learn's 0..16 divided by 16).
    y : ndarray, shape (1797,)
        Labels as float64.

    Examples
    --------
    >>> X, y = load_digits()
    >>> X.shape, float(X.max()), sorted(set(y.tolist()))[:3]
    ((1797, 64), 1.0, [0.0, 1.0, 2.0])
    >>> _, yb = load_digits(binary_digit=0)
    >>> int(yb.sum())
    178
    """
    digit = _check_digit(binary_digit)
    from sklearn.datasets import load_digits as _sk_load_digits

    X_raw, y_raw = _sk_load_digits(return_X_y=True)
    X = np.ascontiguousarray(X_raw, dtype=np.float64) / 16.0
    y = np.asarray(y_raw, dtype=np.float64)
    if digit is not None:
        y = (y == digit).astype(np.float64)
    return X, y


def train_test_split_digits(
    *, seed: int = 0, test_fraction: float = 0.2, binary_digit: int | None = None
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """Split the digits deterministically into training and held-out rows, stratified by digit.

    From every digit, ``round(test_fraction * count)`` rows (chosen with ``numpy.random.default_rng(seed)``)
    are held out. Both parts are shuffled with the same generator, so a contiguous slice of the training rows
    (what a Downpour replica owns) holds a mix of digits. The same ``seed`` always gives the same split.

    Parameters
    ----------
    seed : int, default 0
        Seed of the split and the shuffle.
    test_fraction : float, default 0.2
        Fraction of each digit held out, in (0, 1).
    binary_digit : int, optional
        As in :func:`load_digits`; stratification still uses the digit.

    Returns
    -------
    X_train, y_train, X_test, y_test : ndarray
        C-contiguous float64 arrays.

    Examples
    --------
    >>> X_tr, y_tr, X_te, y_te = train_test_split_digits(seed=1)
    >>> X_tr.shape, X_te.shape
    ((1438, 64), (359, 64))
    """
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise InvalidOptionError(f"seed must be a non-negative integer, got {seed!r}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, int | float):
        raise InvalidOptionError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}")
    if not 0.0 < float(test_fraction) < 1.0:
        raise InvalidOptionError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    digit = _check_digit(binary_digit)
    X, digits = load_digits()
    y = digits if digit is None else (digits == digit).astype(np.float64)
    rng = np.random.default_rng(seed)
    test_parts = []
    train_parts = []
    for d in range(N_CLASSES):
        rows = rng.permutation(np.flatnonzero(digits == d))
        k = round(test_fraction * rows.size)
        test_parts.append(rows[:k])
        train_parts.append(rows[k:])
    train = rng.permutation(np.concatenate(train_parts))
    test = rng.permutation(np.concatenate(test_parts))
    return X[train], y[train], X[test], y[test]  # (fancy indexing makes C-contiguous copies)


def digits_dataset(
    path: str | os.PathLike[str],
    *,
    binary_digit: int | None = None,
    subset: Literal["all", "train", "test"] = "all",
    seed: int = 0,
    test_fraction: float = 0.2,
    portion_rows: int | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Dataset:
    """Write the digits (or its training or held-out part) as a :class:`Dataset` at ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        Target directory or fsspec URL.
    binary_digit : int, optional
        If given (0..9), labels are 1 for that digit and 0 otherwise (``label_kind="binary"``), e.g.
        ``binary_digit=0`` for a logistic "0 vs rest" model. Default: ``label_kind="classes"``, 10 classes.
    subset : {"all", "train", "test"}, default "all"
        All 1,797 rows in scikit-learn's order, or one side of :func:`train_test_split_digits`.
    seed, test_fraction
        Passed to :func:`train_test_split_digits` for ``subset="train"`` / ``"test"``.
    portion_rows : int, optional
        Rows per portion (default: the :class:`Dataset` default, giving 2 portions for all rows).
    overwrite : bool, default False
        Replace an existing dataset at ``path``.
    storage_options : dict, optional
        fsspec options for a URL ``path``.

    Returns
    -------
    Dataset

    Examples
    --------
    >>> import tempfile, os
    >>> root = tempfile.mkdtemp()
    >>> train = digits_dataset(os.path.join(root, "train"), subset="train", binary_digit=0)
    >>> test = digits_dataset(os.path.join(root, "test"), subset="test", binary_digit=0)
    >>> train.n_rows + test.n_rows, train.label_kind, train.n_features
    (1797, 'binary', 64)
    """
    digit = _check_digit(binary_digit)
    if subset == "all":
        X, y = load_digits(binary_digit=digit)
    elif subset in ("train", "test"):
        X_tr, y_tr, X_te, y_te = train_test_split_digits(
            seed=seed, test_fraction=test_fraction, binary_digit=digit
        )
        X, y = (X_tr, y_tr) if subset == "train" else (X_te, y_te)
    else:
        raise InvalidOptionError(f"subset must be 'all', 'train' or 'test', got {subset!r}")
    # Fix the label kind rather than detect it: a subset is still a 10-class (or 0/1) problem.
    return Dataset.from_arrays(
        X, y, path=path, portion_rows=portion_rows, label_kind="classes" if digit is None else "binary",
        n_classes=N_CLASSES if digit is None else None, overwrite=overwrite, storage_options=storage_options,
    )  # fmt: skip


def _check_digit(binary_digit: object) -> int | None:
    if binary_digit is None:
        return None
    if isinstance(binary_digit, bool) or not isinstance(binary_digit, int | np.integer):
        raise InvalidOptionError(f"binary_digit must be an integer 0..9 or None, got {binary_digit!r}")
    if not 0 <= binary_digit <= 9:
        raise InvalidOptionError(f"binary_digit must be an integer 0..9 or None, got {binary_digit!r}")
    return int(binary_digit)
