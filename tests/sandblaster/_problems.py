"""Smooth problems shared by the batch-method tests: ``make() -> (fg, x0)``, ``fg(x) = (F, grad F)``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.special import expit
from sklearn.datasets import load_digits

#: ``fg(x) = (F, grad F)``.
FG = Callable[[np.ndarray], tuple[float, np.ndarray]]
#: What a problem's ``make()`` returns: ``(fg, x0)`` (``_quadratic`` in test_cg_gd: ``(fg, x_star)``).
Problem = tuple[FG, np.ndarray]


def logistic_digits() -> Problem:
    features, labels = load_digits(return_X_y=True)
    x = np.hstack([features / 16.0, np.ones((features.shape[0], 1))])
    t = np.where(labels == 0, 1.0, -1.0)
    l2, n_rows = 1e-3, x.shape[0]

    def fg(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = t * (x @ w)
        f = np.logaddexp(0.0, -z).sum() / n_rows + 0.5 * l2 * (w @ w)
        return float(f), -(x.T @ (t * expit(-z))) / n_rows + l2 * w

    return fg, np.zeros(x.shape[1])


def ill_conditioned_lsq(n: int = 60, rows: int = 200, cond: float = 1e4) -> Problem:
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.standard_normal((rows, n)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = (u * np.sqrt(np.logspace(0, np.log10(cond), n))) @ v.T  # cond(A^T A) = cond
    b = rng.standard_normal(rows)

    def fg(x: np.ndarray) -> tuple[float, np.ndarray]:
        r = a @ x - b
        return 0.5 * float(r @ r), a.T @ r

    return fg, np.zeros(n)


def rosenbrock(n: int = 100) -> Problem:
    def fg(x: np.ndarray) -> tuple[float, np.ndarray]:
        f = np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)
        g = np.zeros_like(x)
        g[:-1] = -400.0 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2.0 * (1.0 - x[:-1])
        g[1:] += 200.0 * (x[1:] - x[:-1] ** 2)
        return float(f), g

    return fg, np.tile([-1.2, 1.0], n // 2)
