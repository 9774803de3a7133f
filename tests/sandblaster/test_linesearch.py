"""Scalar line searches: the Moré-Thuente state machine step for step against SciPy's dcsrch port, the strong
Wolfe conditions on what it accepts, its failure modes, Armijo backtracking, and the small scalar helpers."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize._dcsrch import DCSRCH

from distbelief.errors import InvalidOptionError, ProtocolError
from distbelief.sandblaster._linesearch import (
    LBFGSB_FTOL,
    ArmijoBacktracking,
    LineSearchResult,
    StrongWolfeLineSearch,
    interpolated_initial_step,
    lbfgsb_initial_step,
    relative_reduction_converged,
)
from tests.sandblaster._problems import rosenbrock

Scalar = Callable[[float], float]


_rosenbrock = rosenbrock()[0]  # the shared test problem's objective and gradient


def _line(x: np.ndarray, d: np.ndarray) -> tuple[Scalar, Scalar]:
    def phi(t: float) -> float:
        return _rosenbrock(x + t * d)[0]

    def dphi(t: float) -> float:
        return float(_rosenbrock(x + t * d)[1] @ d)

    return phi, dphi


def _run(ls: StrongWolfeLineSearch, phi: Scalar, dphi: Scalar) -> tuple[LineSearchResult, list[float]]:
    trials: list[float] = []
    while not ls.done:
        t = ls.step
        trials.append(t)
        ls.tell(phi(t), dphi(t))
    assert ls.result is not None
    return ls.result, trials


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(2, 8),
    seed=st.integers(0, 2**32 - 1),
    log_step=st.floats(-4.0, 2.0),
    c2=st.sampled_from([0.1, 0.9]),
    c1=st.sampled_from([1e-4, 1e-3]),
)
def test_matches_scipy_dcsrch_step_for_step(n: int, seed: int, log_step: float, c2: float, c1: float) -> None:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2.0, 2.0, n)
    f0, g0 = _rosenbrock(x)
    d = -g0 * rng.uniform(0.5, 2.0, n)  # a descent direction, not exactly -g
    phi, dphi = _line(x, d)
    step = 10.0**log_step

    oracle_trials: list[float] = []

    def phi_logged(t: float) -> float:
        oracle_trials.append(float(t))
        return phi(t)

    oracle = DCSRCH(phi_logged, dphi, ftol=c1, gtol=c2, xtol=0.1, stpmin=0.0, stpmax=1e10)
    stp, phi_oracle, _, task = oracle(step, phi0=f0, derphi0=float(g0 @ d), maxiter=100)

    ls = StrongWolfeLineSearch(f0, float(g0 @ d), step=step, c1=c1, c2=c2, max_evals=100)
    res, trials = _run(ls, phi, dphi)
    np.testing.assert_allclose(trials, oracle_trials, rtol=1e-12)
    if task.startswith(b"CONV"):
        assert res.status == "converged"
        assert res.step == pytest.approx(stp, rel=1e-12)
        assert res.phi == pytest.approx(phi_oracle, rel=1e-12)
    else:
        assert res.status == "warning"
    assert res.is_last_evaluated
    assert res.step == trials[-1]
    assert res.n_evals == len(trials)
    if res.status == "converged":
        # The strong Wolfe conditions, checked independently.
        assert res.phi <= f0 + c1 * res.step * float(g0 @ d)
        assert res.dphi is not None
        assert abs(res.dphi) <= c2 * abs(float(g0 @ d))


@pytest.mark.parametrize("step", [0.3, 1.0, 3.0])
def test_kink_ends_with_xtol_warning_like_scipy(step: float) -> None:
    # |phi'| = 1 everywhere: the curvature condition can never hold, the bracket shrinks below xtol.
    def phi(t: float) -> float:
        return abs(t - 1.0)

    def dphi(t: float) -> float:
        return 1.0 if t > 1.0 else -1.0

    oracle_trials: list[float] = []

    def phi_logged(t: float) -> float:
        oracle_trials.append(float(t))
        return phi(t)

    oracle = DCSRCH(phi_logged, dphi, ftol=1e-3, gtol=0.9, xtol=0.1, stpmin=0.0, stpmax=1e10)
    _, _, _, task = oracle(step, phi0=1.0, derphi0=-1.0, maxiter=100)
    assert task.startswith(b"WARNING: XTOL")
    res, trials = _run(StrongWolfeLineSearch(1.0, -1.0, step=step, c1=1e-3, max_evals=100), phi, dphi)
    assert trials == oracle_trials
    assert (res.status, res.message) == ("warning", "xtol test satisfied")
    assert res.ok
    # The best point is asked for again before the warning, so the shards hold it.
    assert res.is_last_evaluated
    assert res.step == trials[-1]
    assert res.phi == min(phi(t) for t in trials)


def test_quadratic_is_solved_by_interpolation() -> None:
    def phi(t: float) -> float:
        return (t - 2.0) ** 2

    def dphi(t: float) -> float:
        return 2.0 * (t - 2.0)

    res, trials = _run(StrongWolfeLineSearch(phi(0), dphi(0), step=8.0, c2=0.1), phi, dphi)
    assert res.status == "converged"
    assert res.step == pytest.approx(2.0)
    assert trials == [8.0, pytest.approx(2.0)]
    # Too short a first step: extrapolation (at most 4x beyond, MINPACK's xtrapu) then interpolation.
    res, trials = _run(StrongWolfeLineSearch(phi(0), dphi(0), step=0.01, c2=0.1), phi, dphi)
    assert res.status == "converged"
    assert abs(dphi(res.step)) <= 0.1 * 4.0
    assert all(b <= a + 4.0 * (a - 0.0) + 1e-12 for a, b in itertools.pairwise(trials))


def test_not_a_descent_direction_fails_at_once() -> None:
    for dphi0 in (0.0, 1.0, math.nan):
        ls = StrongWolfeLineSearch(1.0, dphi0)
        assert ls.done
        assert ls.result is not None
        assert ls.result.status == "failed"
        assert ls.result.n_evals == 0
        assert "descent" in ls.result.message or "finite" in ls.result.message


def test_budget_exhausted_reports_best_point() -> None:
    # phi decreases all the way to t = 1e6: one evaluation cannot satisfy the curvature condition.
    def phi(t: float) -> float:
        return -t

    ls = StrongWolfeLineSearch(0.0, -1.0, step=1.0, max_evals=1)
    res = ls.tell(phi(1.0), -1.0)
    assert res is not None
    assert res.status == "failed"
    assert not res.ok
    # The best point is the evaluated one (lower value than t = 0).
    assert (res.step, res.phi, res.is_last_evaluated) == (1.0, -1.0, True)
    # With a worse first trial the best point is the start, which was not the last evaluation.
    ls = StrongWolfeLineSearch(0.0, -1.0, step=1.0, max_evals=1)
    res = ls.tell(5.0, 3.0)
    assert res is not None
    assert (res.status, res.step, res.phi, res.is_last_evaluated) == ("failed", 0.0, 0.0, False)
    with pytest.raises(ProtocolError):
        ls.tell(0.0, 0.0)


def test_non_finite_values_shrink_the_step() -> None:
    # Overflow beyond t = 3; the minimum is at t = 2.5.
    def phi(t: float) -> float:
        return math.inf if t > 3.0 else (t - 2.5) ** 2

    def dphi(t: float) -> float:
        return math.nan if t > 3.0 else 2.0 * (t - 2.5)

    res, trials = _run(StrongWolfeLineSearch(phi(0), dphi(0), step=100.0), phi, dphi)
    assert res.status == "converged"
    assert res.phi <= phi(0) + 1e-4 * res.step * dphi(0)
    assert trials[0] == 100.0
    bad = [t for t in trials if t > 3.0]
    good = trials[len(bad) :]
    assert trials[: len(bad)] == bad  # once finite, it never goes back to the overflow region
    assert all(t < min(bad) for t in good)
    # Everywhere non-finite but at 0: fails cleanly within the budget.
    ls = StrongWolfeLineSearch(1.0, -1.0, step=1.0, max_evals=5)
    res, trials = _run(ls, lambda t: math.inf, lambda t: math.inf)
    assert res.status == "failed"
    assert len(trials) == 5
    assert res.step == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"c1": 0.9, "c2": 0.1},
        {"c1": 0.0},
        {"c2": 1.0},
        {"step": 0.0},
        {"step": math.inf},
        {"step": 2.0, "stpmax": 1.0},
        {"xtol": -1.0},
        {"stpmin": -1.0},
        {"max_evals": 0},
        {"max_evals": 2.5},
    ],
)
def test_invalid_options(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidOptionError):
        StrongWolfeLineSearch(1.0, -1.0, **kwargs)


def test_armijo_backtracking_shrinks_then_grows() -> None:
    def phi(t: float) -> float:
        return (1.0 - t) ** 2

    ls = ArmijoBacktracking(step=4.0, c1=1e-4, shrink=0.5, grow=2.0)
    assert ls.start(phi(0.0), -2.0) == 4.0
    trials = []
    while not ls.done:
        trials.append(ls.step)
        ls.tell(phi(ls.step))
    res = ls.result
    assert res is not None
    assert trials == [4.0, 2.0, 1.0]
    assert (res.status, res.step, res.phi, res.n_evals) == ("converged", 1.0, 0.0, 3)
    assert res.phi <= phi(0.0) + 1e-4 * res.step * -2.0
    assert ls.step_size == 2.0  # next search starts twice as long
    assert ls.start(phi(0.0), -2.0) == 2.0


def test_armijo_failure_and_errors() -> None:
    ls = ArmijoBacktracking(step=1.0, max_evals=3)
    ls.start(0.0, -1.0)
    while not ls.done:
        ls.tell(1.0)  # never a decrease
    assert ls.result is not None
    assert (ls.result.status, ls.result.n_evals, ls.result.step) == ("failed", 3, 0.0)
    assert ls.start(0.0, 1.0) == ls.step_size
    assert ls.done
    assert ls.result is not None
    assert ls.result.status == "failed"
    with pytest.raises(ProtocolError):
        ls.tell(0.0)
    with pytest.raises(ProtocolError):
        ArmijoBacktracking().tell(0.0)
    for kwargs in ({"step": -1.0}, {"c1": 1.0}, {"shrink": 1.0}, {"grow": 0.5}, {"max_evals": 0}):
        with pytest.raises(InvalidOptionError):
            ArmijoBacktracking(**kwargs)


def test_initial_steps() -> None:
    assert lbfgsb_initial_step(0, 4.0) == 0.25
    assert lbfgsb_initial_step(0, 1e-20) == 1e10  # capped at stpmax, as L-BFGS-B does
    assert lbfgsb_initial_step(7, 1e-20) == 1.0
    with pytest.raises(InvalidOptionError):
        lbfgsb_initial_step(0, 0.0)
    # N&W (3.60): a quadratic model through the last decrease; SciPy's first-iteration guess is 1.01/||g||.
    gnorm = 8.0
    assert interpolated_initial_step(3.0, 3.0 + gnorm / 2, -(gnorm**2)) == pytest.approx(1.01 / gnorm)
    assert interpolated_initial_step(1.0, 0.5, -1.0) == 1.0  # f went up: no information, take max_step
    assert interpolated_initial_step(1.0, 100.0, -1.0, max_step=2.0) == 2.0


def test_relative_reduction_rule_is_scipys() -> None:
    assert pytest.approx(2.220446049250313e-09) == LBFGSB_FTOL
    assert relative_reduction_converged(1e6, 1e6 - 1e-4, ftol=LBFGSB_FTOL)
    assert not relative_reduction_converged(1e6, 1e6 - 1e-2, ftol=LBFGSB_FTOL)
    assert relative_reduction_converged(1e-12, 0.0, ftol=LBFGSB_FTOL)  # max(.., 1) near zero
    assert relative_reduction_converged(1.0, 2.0, ftol=0.0)  # an increase always stops
