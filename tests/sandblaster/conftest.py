"""Problems shared by the Sandblaster tests, with SciPy as the oracle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import scipy.optimize

from distbelief import models
from distbelief.storage import load_digits


@dataclass
class Problem:
    model: Any
    X: np.ndarray
    y: np.ndarray
    l2: float
    x0: np.ndarray

    def fun_and_grad(self, w: np.ndarray) -> tuple[float, np.ndarray]:
        return models.objective(self.model, w, self.X, self.y, l2=self.l2)

    def scipy(self, *, m: int = 10, gtol: float = 1e-5, ftol: float = 2.220446049250313e-09) -> Any:
        return scipy.optimize.minimize(
            self.fun_and_grad, self.x0, jac=True, method="L-BFGS-B",
            options={"maxcor": m, "gtol": gtol, "ftol": ftol, "maxiter": 15000, "maxfun": 15000},
        )  # fmt: skip


class ExtendedRosenbrock:
    """A user model (not a built-in): the extended Rosenbrock function, one row per term.

    Row ``i`` holds the index ``k`` of a pair ``(w[2k], w[2k+1])``; its loss is
    ``100 (w[2k+1] - w[2k]^2)^2 + (1 - w[2k])^2``. Summed over all rows this is the classic function.
    """

    def __init__(self, n_params: int) -> None:
        self.n_params = n_params
        self.n_features = 1

    def init_params(self, seed: int | None = None) -> np.ndarray:
        x0 = np.empty(self.n_params)
        x0[0::2], x0[1::2] = -1.2, 1.0
        return x0

    def loss_and_grad(self, w: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        k = X[:, 0].astype(int)
        a, b = w[2 * k], w[2 * k + 1]
        r1, r2 = b - a * a, 1.0 - a
        grad = np.zeros_like(w)
        np.add.at(grad, 2 * k, -400.0 * a * r1 - 2.0 * r2)
        np.add.at(grad, 2 * k + 1, 200.0 * r1)
        return float(np.sum(100.0 * r1 * r1 + r2 * r2)), grad


@pytest.fixture(scope="session")
def digits() -> tuple[np.ndarray, np.ndarray]:
    return load_digits()


@pytest.fixture(scope="session")
def logistic_digits(digits: tuple[np.ndarray, np.ndarray]) -> Problem:
    X, y = digits
    model = models.Logistic(64)
    return Problem(model, X, (y == 0).astype(float), 1e-3, np.zeros(model.n_params))


@pytest.fixture(scope="session")
def softmax_digits(digits: tuple[np.ndarray, np.ndarray]) -> Problem:
    X, y = digits
    model = models.Softmax(64, 10)
    return Problem(model, X, y.astype(float), 1e-3, np.zeros(model.n_params))


@pytest.fixture(scope="session")
def ill_conditioned_least_squares() -> Problem:
    rng = np.random.default_rng(3)
    n, d = 600, 40
    U, _ = np.linalg.qr(rng.standard_normal((n, d)))
    V, _ = np.linalg.qr(rng.standard_normal((d, d)))
    X = (U * np.logspace(0, 1.5, d)) @ V.T  # singular values 1 .. 31.6: condition number 1e3 for X^T X
    y = X @ rng.standard_normal(d) + 0.01 * rng.standard_normal(n)
    model = models.LeastSquares(d, fit_intercept=False)
    return Problem(model, np.ascontiguousarray(X), y, 0.0, np.zeros(model.n_params))


@pytest.fixture(scope="session")
def well_conditioned_least_squares() -> Problem:
    rng = np.random.default_rng(4)
    n, d = 400, 20
    U, _ = np.linalg.qr(rng.standard_normal((n, d)))
    X = U * np.linspace(1.0, 2.0, d)  # condition number 4 for X^T X: gradient descent converges fast
    y = X @ rng.standard_normal(d) + 0.1 * rng.standard_normal(n)
    model = models.LeastSquares(d, fit_intercept=False)
    return Problem(model, np.ascontiguousarray(X), y, 0.0, np.zeros(model.n_params))


@pytest.fixture(scope="session")
def rosenbrock() -> Problem:
    model = ExtendedRosenbrock(100)
    X = np.arange(50, dtype=float)[:, None]
    return Problem(model, X, np.zeros(50), 0.0, model.init_params())
