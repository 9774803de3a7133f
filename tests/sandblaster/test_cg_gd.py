"""Polak-Ribière+ CG and Armijo gradient descent: the scalar decisions against a numpy oracle, and the
reference drivers converging to SciPy L-BFGS-B's optimum."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.sandblaster._cg import polak_ribiere_plus
from tests.sandblaster._problems import Problem, ill_conditioned_lsq, logistic_digits, rosenbrock
from tests.sandblaster._reference import minimize_cg_reference, minimize_gd_reference


@pytest.fixture(autouse=True)
def _one_blas_thread() -> Iterator[None]:
    # These problems are tiny: BLAS threads only add contention (the machine is shared), not speed.
    with threadpool_limits(1):
        yield


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 20),
    seed=st.integers(0, 2**32 - 1),
    since=st.integers(1, 30),
    period=st.integers(1, 30),
)
def test_polak_ribiere_plus_against_vectors(n: int, seed: int, since: int, period: int) -> None:
    rng = np.random.default_rng(seed)
    g0, g1, d0 = rng.standard_normal((3, n))
    beta, restart = polak_ribiere_plus(
        float(g1 @ g1),
        float(g1 @ g0),
        float(g0 @ g0),
        float(g1 @ d0),
        since_restart=since,
        restart_every=period,
    )
    pr = float(g1 @ (g1 - g0)) / float(g0 @ g0)
    d1 = -g1 + beta * d0
    if restart:
        assert beta == 0.0
        assert pr <= 0.0 or since >= period or float(g1 @ (-g1 + pr * d0)) >= 0.0
    else:
        assert beta == pytest.approx(pr, rel=1e-12)
        assert since < period
        assert float(g1 @ d1) < 0.0  # a descent direction


def test_polak_ribiere_plus_edge_cases() -> None:
    assert polak_ribiere_plus(1.0, 0.5, 4.0, -0.1, since_restart=1, restart_every=10) == (0.125, False)
    assert polak_ribiere_plus(1.0, 0.5, 4.0, -0.1, since_restart=10, restart_every=10) == (0.0, True)
    # beta > 0 but g.d_new = -1 + 0.125 * 10 > 0: not a descent direction, restart.
    assert polak_ribiere_plus(1.0, 0.5, 4.0, 10.0, since_restart=1, restart_every=10) == (0.0, True)
    assert polak_ribiere_plus(1.0, 0.5, 0.0, -1.0, since_restart=1, restart_every=10) == (0.0, True)
    with pytest.raises(InvalidOptionError):
        polak_ribiere_plus(1.0, 0.5, 4.0, -0.1, since_restart=1, restart_every=0)
    with pytest.raises(DatasetError):
        polak_ribiere_plus(float("nan"), 0.5, 4.0, -0.1, since_restart=1, restart_every=3)


@pytest.mark.parametrize("make", [logistic_digits, ill_conditioned_lsq, rosenbrock])
def test_cg_reaches_the_lbfgsb_optimum(make: Callable[[], Problem]) -> None:
    fg, x0 = make()
    best = minimize(
        fg, x0, jac=True, method="L-BFGS-B", options={"gtol": 1e-9, "ftol": 1e-14, "maxiter": 5000}
    )
    r = minimize_cg_reference(fg, x0, gtol=1e-6, ftol=1e-12, maxiter=20000)
    assert r.success, r.message
    # Relative objective gap, measured against max(|f*|, 1) as L-BFGS-B's ftol rule does (f* = 0 for
    # Rosenbrock).
    assert abs(r.fun - best.fun) <= 1e-6 * max(abs(best.fun), 1.0)
    assert r.nfev >= r.nit + 1


def test_cg_restarts_every_iteration_is_steepest_descent_with_wolfe() -> None:
    # restart_every=1 forces beta = 0: still converges on a well-conditioned quadratic.
    h = np.diag(np.linspace(1.0, 4.0, 10))
    x_star = np.linspace(-1.0, 1.0, 10)

    def fg(x: np.ndarray) -> tuple[float, np.ndarray]:
        e = x - x_star
        return 0.5 * float(e @ h @ e), h @ e

    r = minimize_cg_reference(fg, np.zeros(10), gtol=1e-9, ftol=0.0, restart_every=1, maxiter=2000)
    assert r.success
    np.testing.assert_allclose(r.x, x_star, atol=1e-8)
    # Plain CG on an n-dimensional quadratic, for comparison, needs far fewer iterations.
    cg = minimize_cg_reference(fg, np.zeros(10), gtol=1e-9, ftol=0.0, maxiter=2000)
    assert cg.nit < r.nit


def _quadratic(n: int = 30, cond: float = 10.0, seed: int = 3) -> Problem:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    h = (q * np.linspace(1.0, cond, n)) @ q.T
    b = rng.standard_normal(n)

    def fg(x: np.ndarray) -> tuple[float, np.ndarray]:
        return 0.5 * float(x @ h @ x) - float(b @ x), h @ x - b

    return fg, np.linalg.solve(h, b)


@pytest.mark.parametrize("step", [1e-6, 1.0, 100.0])
def test_gd_decreases_monotonically_and_converges(step: float) -> None:
    fg, x_star = _quadratic()
    history: list[float] = []
    r = minimize_gd_reference(fg, np.zeros(x_star.size), gtol=1e-8, ftol=0.0, step=step, history=history)
    assert r.success, r.message
    # Armijo forces a decrease; only at the rounding level (c1*t*g.g below eps*|f|) may f stay put.
    assert all(b <= a for a, b in itertools.pairwise(history))
    assert all(b < a for a, b in itertools.pairwise(history[:20]))
    assert len(history) == r.nit + 1
    np.testing.assert_allclose(r.x, x_star, atol=1e-7)
    assert r.fun == pytest.approx(fg(x_star)[0], rel=1e-12)
    # The step grows after successes: even from 1e-6 the run stays short on a condition-10 problem.
    assert r.nit < 400


def test_gd_budget_and_bad_input() -> None:
    fg, x_star = _quadratic()
    r = minimize_gd_reference(fg, np.zeros(x_star.size), maxiter=3)
    assert (r.success, r.nit) == (False, 3)
    with pytest.raises(DatasetError):
        minimize_gd_reference(lambda x: (float("inf"), x), np.ones(2))
    with pytest.raises(InvalidOptionError):
        minimize_gd_reference(fg, np.zeros(x_star.size), step=-1.0)
    with pytest.raises(InvalidOptionError):
        minimize_cg_reference(fg, np.zeros(x_star.size), maxiter=0)
