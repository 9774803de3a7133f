"""Nonlinear conjugate gradients (Polak-Ribière+) as scalar decisions, for Sandblaster (DistBelief, sec. 4.2).

The paper's Sandblaster runs "a variety of batch optimization procedures" through one coordinator that only
sees scalars. For nonlinear CG the direction update ``d_new = -g_new + beta * d`` needs four dot products,
``g_new.g_new``, ``g_new.g``, ``g.g`` and ``g_new.d``; :func:`polak_ribiere_plus` turns them into ``beta``
and a restart decision, and the shards apply ``lincomb("d", [-1, beta], ["g_new", "d"])``.

``beta = max(0, g_new.(g_new - g) / g.g)`` is Polak-Ribière+ (Nocedal & Wright, *Numerical Optimization*,
2nd ed., (5.44)-(5.45)); with a strong Wolfe line search with ``c2 = 0.1`` it is the standard robust choice.
The direction restarts from steepest descent when ``beta`` is clipped to 0, every ``restart_every``
iterations (``n``, N&W section 5.2), or when ``d_new`` would not be a descent direction.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.sandblaster._linesearch import (
    LBFGSB_FTOL,
    ReferenceResult,
    StrongWolfeLineSearch,
    interpolated_initial_step,
    relative_reduction_converged,
)

__all__ = ["CG_C1", "CG_C2", "minimize_cg_reference", "polak_ribiere_plus"]

#: Strong Wolfe constants for nonlinear CG: c2 = 0.1 keeps consecutive directions nearly conjugate.
CG_C1 = 1e-4
CG_C2 = 0.1


def polak_ribiere_plus(
    g1g1: float,
    g1g0: float,
    g0g0: float,
    g1d: float,
    *,
    since_restart: int,
    restart_every: int,
) -> tuple[float, bool]:
    """Polak-Ribière+ ``beta`` and the restart decision, from dot products only.

    Parameters
    ----------
    g1g1, g1g0, g0g0 : float
        ``g_new.g_new``, ``g_new.g_old`` and ``g_old.g_old``.
    g1d : float
        ``g_new.d_old``, the slope at the accepted point along the old direction (the line search's
        final ``phi'``), needed to check that ``d_new = -g_new + beta*d_old`` is a descent direction:
        ``g_new.d_new = -g1g1 + beta*g1d < 0``.
    since_restart : int
        Iterations done since the direction was last ``-g`` (1 right after the first step from ``-g``).
    restart_every : int
        Restart period, usually the number of parameters ``n``.

    Returns
    -------
    beta : float
        Coefficient of the old direction (0 on restart).
    restart : bool
        True when the new direction is plain steepest descent ``-g_new``.

    Examples
    --------
    >>> polak_ribiere_plus(1.0, 0.5, 4.0, -0.1, since_restart=1, restart_every=10)
    (0.125, False)
    >>> polak_ribiere_plus(1.0, 2.0, 4.0, -0.1, since_restart=1, restart_every=10)   # beta < 0: clip
    (0.0, True)
    """
    if isinstance(restart_every, bool) or not isinstance(restart_every, int) or restart_every < 1:
        raise InvalidOptionError(f"restart_every must be an int >= 1, got {restart_every!r}")
    if not all(math.isfinite(v) for v in (g1g1, g1g0, g0g0, g1d)):
        raise DatasetError(
            "non-finite dot products in the CG update: the gradient holds NaN/inf; check the data and model"
        )
    if not g0g0 > 0.0:
        return 0.0, True
    beta = max(0.0, (g1g1 - g1g0) / g0g0)
    if beta == 0.0 or since_restart >= restart_every:
        return 0.0, True
    if -g1g1 + beta * g1d >= 0.0:
        # Not a descent direction (possible with an inexact line search): fall back to -g_new.
        return 0.0, True
    return beta, False


def minimize_cg_reference(
    fun_and_grad: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x0: np.ndarray,
    *,
    gtol: float = 1e-5,
    ftol: float = LBFGSB_FTOL,
    maxiter: int = 15000,
    restart_every: int | None = None,
    c1: float = CG_C1,
    c2: float = CG_C2,
    maxls: int = 30,
) -> ReferenceResult:
    """In-memory Polak-Ribière+ CG driven the way the coordinator drives it (scalars in, scalars out).

    The initial step of each line search is SciPy's guess from the last decrease
    (:func:`sandblaster._linesearch.interpolated_initial_step`, with ``phi_prev = f + ||g||/2`` on the
    first iteration). Stops on ``max|g_i| <= gtol`` or a relative decrease ``<= ftol`` (L-BFGS-B's rules).
    A failed line search along a CG direction restarts from ``-g``; one along ``-g`` ends the run.

    Parameters
    ----------
    fun_and_grad : callable
        ``x -> (F(x), grad F(x))``.
    x0 : numpy.ndarray
        Starting point.
    gtol, ftol, maxiter : float, float, int
        Stopping rules.
    restart_every : int or None
        Restart period; ``None`` means ``len(x0)``.
    c1, c2 : float
        Strong Wolfe constants (``1e-4``, ``0.1``).
    maxls : int
        Evaluations per line search.

    Returns
    -------
    ReferenceResult

    Examples
    --------
    >>> fg = lambda x: (float(x @ x), 2 * x)
    >>> r = minimize_cg_reference(fg, np.array([3.0, -4.0]))
    >>> r.success, round(r.fun, 12)
    (True, 0.0)
    """
    if not (gtol >= 0.0 and ftol >= 0.0):
        raise InvalidOptionError(f"gtol and ftol must be >= 0, got gtol={gtol!r}, ftol={ftol!r}")
    if isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1:
        raise InvalidOptionError(f"maxiter must be an int >= 1, got {maxiter!r}")
    x = np.array(x0, dtype=np.float64, copy=True).ravel()
    period = x.size if restart_every is None else restart_every
    f, g = fun_and_grad(x)
    f, g = float(f), np.asarray(g, dtype=np.float64)
    nfev = 1
    if not (math.isfinite(f) and np.all(np.isfinite(g))):
        raise DatasetError("the objective or its gradient is not finite at x0; check the data and x0")
    gg = float(g @ g)
    if float(np.max(np.abs(g), initial=0.0)) <= gtol:
        return ReferenceResult(x, f, 0, nfev, True, "gradient inf-norm <= gtol at x0")
    d = -g
    since_restart = 0
    f_prev = f + math.sqrt(gg) / 2.0  # SciPy's first-iteration guess: the step becomes ~1/||g||
    nit = 0
    while True:
        gd = float(g @ d)
        ls = StrongWolfeLineSearch(
            f, gd, step=interpolated_initial_step(f, f_prev, gd), c1=c1, c2=c2, max_evals=maxls
        )
        xt, ft, gt = x, f, g
        while not ls.done:
            xt = x + ls.step * d
            ft, gt = fun_and_grad(xt)
            ft, gt = float(ft), np.asarray(gt, dtype=np.float64)
            nfev += 1
            ls.tell(ft, float(gt @ d) if np.all(np.isfinite(gt)) else math.nan)
        res = ls.result
        assert res is not None
        if not res.ok:
            if since_restart > 0:
                d, since_restart = -g, 0
                continue
            return ReferenceResult(x, f, nit, nfev, False, f"line search failed: {res.message}")
        nit += 1
        f_prev, x, f = f, xt, ft
        g1g1, g1g0, g1d = float(gt @ gt), float(gt @ g), float(gt @ d)
        g_old_sq, g = gg, gt
        gg = g1g1
        if float(np.max(np.abs(g))) <= gtol:
            return ReferenceResult(x, f, nit, nfev, True, "gradient inf-norm <= gtol")
        if relative_reduction_converged(f_prev, f, ftol=ftol):
            return ReferenceResult(x, f, nit, nfev, True, "relative reduction of f <= ftol")
        if nit >= maxiter:
            return ReferenceResult(x, f, nit, nfev, False, "maximum number of iterations reached")
        beta, restart = polak_ribiere_plus(
            g1g1, g1g0, g_old_sq, g1d, since_restart=since_restart + 1, restart_every=period
        )
        d = -g + beta * d
        since_restart = 0 if restart else since_restart + 1
