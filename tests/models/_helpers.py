"""Helpers shared by the model tests: finite differences and random problems."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from distbelief.models import Model

FloatArray = NDArray[np.float64]


def fd_gradient(
    model: Model, w: FloatArray, X: FloatArray, y: NDArray[np.generic], eps: float = 1e-6
) -> FloatArray:
    """Central finite differences of ``model.loss_and_grad(., X, y)[0]``, one coordinate at a time."""
    grad = np.empty_like(w)
    step = np.zeros_like(w)
    for i in range(w.size):
        step[i] = eps
        plus = model.loss_and_grad(w + step, X, y)[0]
        minus = model.loss_and_grad(w - step, X, y)[0]
        grad[i] = (plus - minus) / (2 * eps)
        step[i] = 0.0
    return grad


def assert_gradient_matches(model: Model, w: FloatArray, X: FloatArray, y: NDArray[np.generic]) -> None:
    """The analytic gradient equals central differences to within their truncation/rounding error."""
    loss, grad = model.loss_and_grad(w, X, y)
    assert np.isfinite(loss)
    assert grad.shape == (model.n_params,)
    assert grad.dtype == np.float64
    expected = fd_gradient(model, w, X, y)
    # Central differences with eps=1e-6 are accurate to ~1e-9 * |loss| (rounding) + eps^2 * f''' (truncation).
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6 * max(1.0, abs(loss)))
