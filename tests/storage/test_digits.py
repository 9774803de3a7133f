"""Tests of storage._digits against scikit-learn's own copy of the digits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sklearn.datasets

from distbelief.errors import InvalidOptionError
from distbelief.storage._digits import digits_dataset, load_digits, train_test_split_digits


@pytest.fixture(scope="module")
def sk_digits() -> tuple[np.ndarray, np.ndarray]:
    X, y = sklearn.datasets.load_digits(return_X_y=True)
    return X, y


def _sorted_rows(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    table = np.column_stack([X, y])
    return table[np.lexsort(table.T[::-1])]


def test_load_digits_matches_sklearn_scaled(sk_digits: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = load_digits()
    assert X.shape == (1797, 64) and y.shape == (1797,)
    assert X.dtype == np.float64 and y.dtype == np.float64 and X.flags.c_contiguous
    np.testing.assert_array_equal(X, sk_digits[0] / 16.0)
    np.testing.assert_array_equal(y, sk_digits[1])
    assert X.min() == 0.0 and X.max() == 1.0
    assert sorted(np.unique(y).tolist()) == list(range(10))


@pytest.mark.parametrize("digit", [0, 7])
def test_binary_digit_labels(digit: int, sk_digits: tuple[np.ndarray, np.ndarray]) -> None:
    _, y = load_digits(binary_digit=digit)
    np.testing.assert_array_equal(y, (sk_digits[1] == digit).astype(float))


@pytest.mark.parametrize("bad", [-1, 10, 1.0, True, "0"])
def test_bad_binary_digit(bad: object) -> None:
    with pytest.raises(InvalidOptionError, match="binary_digit"):
        load_digits(binary_digit=bad)  # type: ignore[arg-type]


def test_split_is_deterministic_stratified_and_complete(sk_digits: tuple[np.ndarray, np.ndarray]) -> None:
    a = train_test_split_digits(seed=3)
    b = train_test_split_digits(seed=3)
    c = train_test_split_digits(seed=4)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(a[0], c[0])
    X_tr, y_tr, X_te, y_te = a
    # Train and test together are exactly the original rows (as a multiset).
    X, y = sk_digits[0] / 16.0, sk_digits[1].astype(float)
    np.testing.assert_array_equal(
        _sorted_rows(np.concatenate([X_tr, X_te]), np.concatenate([y_tr, y_te])), _sorted_rows(X, y)
    )
    for d in range(10):
        assert np.sum(y_te == d) == round(0.2 * np.sum(y == d))
    # Training rows are shuffled: the first 100 rows already hold every digit.
    assert set(y_tr[:100].tolist()) == set(range(10))


def test_split_binary_labels_follow_the_digits() -> None:
    X_tr, y_tr, X_te, y_te = train_test_split_digits(seed=0, binary_digit=0, test_fraction=0.5)
    X_tr10, digits_tr, _, digits_te = train_test_split_digits(seed=0, test_fraction=0.5)
    np.testing.assert_array_equal(X_tr, X_tr10)  # same rows in the same order, only the labels differ
    np.testing.assert_array_equal(y_tr, (digits_tr == 0).astype(float))
    np.testing.assert_array_equal(y_te, (digits_te == 0).astype(float))
    assert abs(X_te.shape[0] - 1797 / 2) <= 10


@pytest.mark.parametrize(
    "kwargs",
    [{"seed": -1}, {"seed": 1.5}, {"test_fraction": 0.0}, {"test_fraction": 1.0}, {"test_fraction": "x"}],
)
def test_bad_split_options(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidOptionError):
        train_test_split_digits(**kwargs)  # type: ignore[arg-type]


def test_digits_dataset_all_rows(tmp_path: Path) -> None:
    ds = digits_dataset(tmp_path / "all")
    assert (ds.n_rows, ds.n_features, ds.label_kind, ds.n_classes) == (1797, 64, "classes", 10)
    assert ds.n_portions == 2
    X, y = ds.read_all()
    X0, y0 = load_digits()
    np.testing.assert_array_equal(X, X0)
    np.testing.assert_array_equal(y, y0)


def test_digits_dataset_binary_train_and_test(tmp_path: Path) -> None:
    train = digits_dataset(tmp_path / "train", binary_digit=0, subset="train", seed=2, portion_rows=256)
    test = digits_dataset(tmp_path / "test", binary_digit=0, subset="test", seed=2)
    X_tr, y_tr, X_te, y_te = train_test_split_digits(seed=2, binary_digit=0)
    assert (train.label_kind, train.n_classes, test.label_kind) == ("binary", 2, "binary")
    assert train.n_portions == -(-X_tr.shape[0] // 256)
    np.testing.assert_array_equal(train.read_all()[0], X_tr)
    np.testing.assert_array_equal(train.read_labels(), y_tr)
    np.testing.assert_array_equal(test.read_all()[0], X_te)
    np.testing.assert_array_equal(test.read_labels(), y_te)


def test_digits_dataset_bad_options(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="subset"):
        digits_dataset(tmp_path / "d", subset="validation")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="binary_digit"):
        digits_dataset(tmp_path / "d", binary_digit=11)
    assert list(tmp_path.iterdir()) == []
