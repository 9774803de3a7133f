"""Batch gradient descent with Armijo backtracking, for Sandblaster (DistBelief, section 4.2).

The simplest of the batch methods the paper's Sandblaster framework hosts: ``x <- x - t*g`` with ``t`` from
:class:`sandblaster._linesearch.ArmijoBacktracking` (Nocedal & Wright, *Numerical Optimization*, 2nd ed.,
Algorithm 3.1), whose step grows after each success and shrinks on each rejected trial. The coordinator
needs ``g.g`` (for ``phi'(0) = -g.g``) and ``F`` at each trial point; the shards do ``x + t*(-g)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.sandblaster._linesearch import (
    LBFGSB_FTOL,
    ArmijoBacktracking,
    ReferenceResult,
    relative_reduction_converged,
)

__all__ = ["minimize_gd_reference"]


def minimize_gd_reference(
    fun_and_grad: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x0: np.ndarray,
    *,
    gtol: float = 1e-5,
    ftol: float = LBFGSB_FTOL,
    maxiter: int = 15000,
    step: float = 1.0,
    c1: float = 1e-4,
    shrink: float = 0.5,
    grow: float = 2.0,
    max_evals: int = 40,
    history: list[float] | None = None,
) -> ReferenceResult:
    """In-memory gradient descent with Armijo backtracking, driven through scalars as the coordinator does.

    Parameters
    ----------
    fun_and_grad : callable
        ``x -> (F(x), grad F(x))``.
    x0 : numpy.ndarray
        Starting point.
    gtol, ftol, maxiter : float, float, int
        Stop on ``max|g_i| <= gtol``, a relative decrease ``<= ftol``, or after ``maxiter`` steps.
    step, c1, shrink, grow, max_evals : float or int
        Options of :class:`sandblaster._linesearch.ArmijoBacktracking`.
    history : list of float, optional
        If given, the objective after every accepted step is appended (``F(x0)`` first).

    Returns
    -------
    ReferenceResult

    Examples
    --------
    >>> fg = lambda x: (float(x @ x), 2 * x)
    >>> r = minimize_gd_reference(fg, np.array([3.0, -4.0]), step=0.1)
    >>> r.success, r.fun < 1e-8
    (True, True)
    """
    if not (gtol >= 0.0 and ftol >= 0.0):
        raise InvalidOptionError(f"gtol and ftol must be >= 0, got gtol={gtol!r}, ftol={ftol!r}")
    if isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1:
        raise InvalidOptionError(f"maxiter must be an int >= 1, got {maxiter!r}")
    search = ArmijoBacktracking(step=step, c1=c1, shrink=shrink, grow=grow, max_evals=max_evals)
    x = np.array(x0, dtype=np.float64, copy=True).ravel()
    f, g = fun_and_grad(x)
    f, g = float(f), np.asarray(g, dtype=np.float64)
    nfev = 1
    if not (math.isfinite(f) and np.all(np.isfinite(g))):
        raise DatasetError("the objective or its gradient is not finite at x0; check the data and x0")
    if history is not None:
        history.append(f)
    nit = 0
    while True:
        if float(np.max(np.abs(g), initial=0.0)) <= gtol:
            return ReferenceResult(x, f, nit, nfev, True, "gradient inf-norm <= gtol")
        if nit >= maxiter:
            return ReferenceResult(x, f, nit, nfev, False, "maximum number of iterations reached")
        search.start(f, -float(g @ g))
        xt, ft, gt = x, f, g
        while not search.done:
            xt = x - search.step * g
            ft, gt = fun_and_grad(xt)
            ft = float(ft)
            nfev += 1
            search.tell(ft)
        res = search.result
        assert res is not None
        if not res.ok:
            return ReferenceResult(x, f, nit, nfev, False, f"line search failed: {res.message}")
        nit += 1
        f_old, x, f, g = f, xt, ft, np.asarray(gt, dtype=np.float64)
        if history is not None:
            history.append(f)
        if relative_reduction_converged(f_old, f, ftol=ftol):
            return ReferenceResult(x, f, nit, nfev, True, "relative reduction of f <= ftol")
