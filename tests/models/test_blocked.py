"""The fused, row-blocked single pass of the linear models, against a plain numpy two-pass reference and
against the models' own two-pass path, and which inputs take it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray
from scipy.special import expit, logsumexp

from distbelief.errors import DatasetError
from distbelief.models import LeastSquares, Logistic, Softmax, _linear

FloatArray = NDArray[np.float64]
LinearModel = LeastSquares | Logistic | Softmax

FAST = settings(max_examples=30, deadline=None)

rows = st.integers(1, 40)
features = st.integers(1, 7)
classes = st.integers(2, 5)
block_rows = st.integers(1, 9)
seeds = st.integers(0, 2**32 - 1)
scales = st.sampled_from([0.1, 1.0, 4.0])


@contextmanager
def _blocked(block: int | Literal["auto"] | None, n_features: int = 1) -> Iterator[list[int]]:
    """Force the fused path on any ``X`` with ``block`` rows per block (None: force the two-pass path;
    "auto": the module's own thresholds).

    Yields the list of ``rows`` that every fused pass was run with.
    """
    calls: list[int] = []
    fused = _linear._Linear._fused_pass

    def counting(
        self: _linear._Linear,
        w: FloatArray,
        X: FloatArray,
        rows: int,
        residual_: _linear.BlockResidual,
        Z_all: FloatArray | None = None,
    ) -> tuple[float, FloatArray]:
        calls.append(rows)
        return fused(self, w, X, rows, residual_, Z_all)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_linear._Linear, "_fused_pass", counting)
        if block is None:
            mp.setattr(_linear, "_BLOCK_MIN_BYTES", 1 << 62)
        elif block != "auto":
            mp.setattr(_linear, "_BLOCK_MIN_BYTES", 0)
            mp.setattr(_linear, "_BLOCK_BYTES", block * n_features * 8)
        yield calls


def _reference(
    model: LinearModel, w: FloatArray, X: FloatArray, y: FloatArray
) -> tuple[float, FloatArray, float]:
    """The loss and gradient in plain numpy, two passes over ``X``, independent of the models' code.

    Also returns ``sum(|Z|)``: the naive ``logsumexp(Z_i) - Z_{i,y_i}`` here cancels where the models' log1p
    form does not, so the reference loss is only accurate to ~eps times that.
    """
    k = model.n_classes if isinstance(model, Softmax) else 1
    d = X.shape[1]
    coef = w[: d * k].reshape(d, k)
    Z = X @ coef + (w[d * k :] if model.fit_intercept else 0.0)
    if isinstance(model, LeastSquares):
        R = Z - y[:, None]
        loss = 0.5 * float((R**2).sum())
    elif isinstance(model, Logistic):
        loss = float(np.logaddexp(0.0, (1.0 - 2.0 * y) * Z[:, 0]).sum())
        R = expit(Z) - y[:, None]
    else:
        labels = y.astype(np.intp)
        loss = float((logsumexp(Z, axis=1) - Z[np.arange(len(y)), labels]).sum())
        R = np.exp(Z - logsumexp(Z, axis=1, keepdims=True))
        R[np.arange(len(y)), labels] -= 1.0
    grad = (X.T @ R).ravel()
    if model.fit_intercept:
        grad = np.concatenate([grad, R.sum(axis=0)])
    return loss, grad, float(np.abs(Z).sum())


def _problem(
    model: LinearModel, n: int, seed: int, scale: float
) -> tuple[FloatArray, FloatArray, FloatArray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(scale=scale, size=(n, model.n_features))
    w = rng.normal(size=model.n_params)
    if isinstance(model, LeastSquares):
        y = rng.normal(size=n)
    else:
        y = rng.integers(0, 2 if isinstance(model, Logistic) else model.n_classes, size=n).astype(float)
    return w, X, y


def _check_blocked(model: LinearModel, n: int, block: int, seed: int, scale: float) -> None:
    """The fused pass equals the reference to 1e-11 and the two-pass path up to summation order."""
    w, X, y = _problem(model, n, seed, scale)
    with _blocked(block, model.n_features) as calls:
        loss, grad = model.loss_and_grad(w, X, y)
    assert calls == [block]
    with _blocked(None) as calls:
        loss2, grad2 = model.loss_and_grad(w, X, y)
    assert calls == []
    ref_loss, ref_grad, z_size = _reference(model, w, X, y)
    assert grad.shape == (model.n_params,)
    # Gradient entries can cancel to ~0: bound the error by the size of the summed terms as well.
    atol = 1e-12 * (1.0 + float(np.abs(X).sum()) * max(1.0, float(np.abs(ref_grad).max())))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-11, atol=1e-13 * z_size)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-11, atol=atol)
    np.testing.assert_allclose(loss, loss2, rtol=1e-13)
    np.testing.assert_allclose(grad, grad2, rtol=1e-12, atol=atol)


@FAST
@given(n=rows, d=features, block=block_rows, intercept=st.booleans(), seed=seeds, scale=scales)
def test_least_squares_blocked(n: int, d: int, block: int, intercept: bool, seed: int, scale: float) -> None:
    _check_blocked(LeastSquares(d, fit_intercept=intercept), n, block, seed, scale)


@FAST
@given(n=rows, d=features, block=block_rows, intercept=st.booleans(), seed=seeds, scale=scales)
def test_logistic_blocked(n: int, d: int, block: int, intercept: bool, seed: int, scale: float) -> None:
    _check_blocked(Logistic(d, fit_intercept=intercept), n, block, seed, scale)


@FAST
@given(n=rows, d=features, k=classes, block=block_rows, intercept=st.booleans(), seed=seeds, scale=scales)
def test_softmax_blocked(
    n: int, d: int, k: int, block: int, intercept: bool, seed: int, scale: float
) -> None:
    _check_blocked(Softmax(d, k, fit_intercept=intercept), n, block, seed, scale)


@pytest.mark.parametrize("n", [1, 7, 8, 9])
def test_edge_row_counts(n: int) -> None:
    """One row, fewer rows than a block, exactly one block, and one row past it."""
    for model in (LeastSquares(3), Logistic(3, fit_intercept=False), Softmax(3, 4)):
        _check_blocked(model, n, 8, seed=n, scale=1.0)


def _models(d: int) -> list[LinearModel]:
    return [LeastSquares(d), Logistic(d), Softmax(d, 10)]


def test_big_x_takes_the_fused_path() -> None:
    """Above _BLOCK_MIN_BYTES (8 MiB) a C-contiguous X is read in ~512 KiB blocks: 131 rows of 500 floats."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(2100, 500))  # 8.4 MB
    assert X.nbytes > _linear._BLOCK_MIN_BYTES
    y = rng.integers(0, 2, size=2100).astype(float)
    for model in _models(500):
        w = rng.normal(scale=0.05, size=model.n_params)
        with _blocked(None):
            loss2, grad2 = model.loss_and_grad(w, X, y)
        with _blocked("auto") as calls:
            loss, grad = model.loss_and_grad(w, X, y)
        assert calls == [131]
        np.testing.assert_allclose(loss, loss2, rtol=1e-12)
        np.testing.assert_allclose(grad, grad2, rtol=1e-11, atol=1e-11 * np.abs(grad2).max())


def test_small_or_strided_x_keeps_the_two_pass_path() -> None:
    """Small X (digits-sized), a Fortran-ordered and a column-strided big X: no fused pass, no copy."""
    rng = np.random.default_rng(1)
    big = rng.normal(size=(2100, 1000))
    cases = [rng.normal(size=(1797, 64)), np.asfortranarray(big[:, :500]), big[:, ::2]]
    for X in cases:
        y = rng.integers(0, 2, size=X.shape[0]).astype(float)
        assert _linear._block_rows(X, 1) == _linear._block_rows(X, 10) == 0
        for model in _models(X.shape[1]):
            with _blocked("auto") as calls:
                model.loss_and_grad(np.zeros(model.n_params), X, y)
            assert calls == []


def test_block_rows() -> None:
    """Bytes per block set the rows; the small-GEMM cap applies to several classes unless it is tiny."""
    X = np.empty((20_000, 500))  # 80 MB, never touched
    assert _linear._block_rows(X, 1) == 131
    assert _linear._block_rows(X, 10) == 131  # 131 * 500 * 10 is under the 1e6 cap
    assert _linear._block_rows(X, 50) == 40  # capped: 40 * 500 * 50 = 1e6
    assert _linear._block_rows(X, 300) == 131  # the cap (6 rows) would be too small: not applied
    assert _linear._block_rows(np.empty((2, 2_000_000)), 1) == 1  # rows wider than a block
    assert _linear._block_rows(np.empty((20_000, 500), dtype=np.float32), 1) == 0


@pytest.mark.parametrize("model", [LeastSquares(3), Logistic(3), Softmax(3, 3)], ids=lambda m: m.kind)
def test_fused_path_diagnoses_nonfinite_rows(model: LinearModel) -> None:
    rng = np.random.default_rng(2)
    X = rng.normal(size=(20, 3))
    X[13, 1] = np.nan
    y = rng.integers(0, 2, size=20).astype(float)
    with _blocked(4, 3) as calls, pytest.raises(DatasetError, match="first at row 13"):
        model.loss_and_grad(np.zeros(model.n_params), X, y)
    assert calls == [4]


def test_fused_path_diagnoses_nonfinite_targets() -> None:
    y = np.zeros(10)
    y[7] = np.inf
    with _blocked(3, 2), pytest.raises(DatasetError, match=r"targets y .* \(first at row 7\)"):
        LeastSquares(2).loss_and_grad(np.zeros(3), np.ones((10, 2)), y)
