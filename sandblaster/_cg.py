"""Nonlinear conjugate gradients (Polak-Ribière+) as scalar decisions, for Sandblaster (DistBelief, sec. 4.2).

The paper's Sandblaster runs "a variety of batch optimization procedures" through one coordinator that only
sees scalars. For nonlinear CG the direction update ``d_new = -g_new + beta * d`` needs four dot products,
``g_new.g_new``, ``g_new.g``, ``g.g`` and ``g_new.d``; :func:`polak_ribiere_plus` turns them into ``beta``
and a restart decision, and the shards apply ``lincomb("d", [-1, beta], ["g_new", "d"])``.

``beta = max(0, g_new.(g_new - g) / g.g)`` is Polak-Ribière+ (Nocedal & Wright, *Numerical Optimization*,
2nd ed., (5.44)-(5.45)); with a strong Wolfe line search with ``c2 = 0.1`` it is the standard robust choice.
The direction restarts from steepest descent when ``beta`` is clipped to 0, every ``restart_every``
iterations (``n``, N&W section 5.2), or when ``d_new`` would not be a descent direction. :func:`_minimize_cg`
is the method, written once against :class:`sandblaster._space.ParameterSpace`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from distbelief.errors import DatasetError, InvalidOptionError

from ._linesearch import (
    LBFGSB_STPMAX,
    interpolated_initial_step,
)
from ._space import (
    IterationRecord,
    ParameterSpace,
    accept_trial,
    close_iteration,
    other_buffer,
    stop_test,
    wolfe_search,
)

__all__ = ["CG_C1", "CG_C2", "_minimize_cg", "polak_ribiere_plus"]

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


def _minimize_cg(
    space: ParameterSpace,
    *,
    gtol: float,
    ftol: float,
    maxiter: int,
    maxfev: int,
    maxls: int = 20,
    restart_every: int,
    callback: Callable[[IterationRecord], None] | None = None,
) -> tuple[bool, str]:
    """Polak-Ribière+ nonlinear CG with restarts in ``space`` (scalars in, scalars out), its line search
    strong Wolfe with :data:`CG_C1` and :data:`CG_C2`.

    The initial step of each line search is SciPy's guess from the last decrease
    (:func:`sandblaster._linesearch.interpolated_initial_step`, with ``phi_prev = f + ||g||/2`` on the
    first iteration). Stops on ``max|g_i| <= gtol`` or a relative decrease ``<= ftol`` (L-BFGS-B's rules).
    A failed line search along a CG direction restarts from ``-g``; one along ``-g`` ends the run.

    Parameters
    ----------
    space : ParameterSpace
        Started (``state.f``, ``state.g_inf`` hold ``F`` at ``state.x``).
    gtol, ftol, maxiter, maxfev : float, float, int, int
        Stopping rules.
    maxls : int
        Evaluations per line search.
    restart_every : int
        Restart period, usually the number of parameters.
    callback : callable, optional
        Called with each iteration's record.

    Returns
    -------
    success : bool
        Whether a convergence test stopped the run.
    message : str
        Why it stopped.

    Examples
    --------
    >>> import numpy as np
    >>> from distbelief.sandblaster._space import InProcessSpace
    >>> space = InProcessSpace(lambda x: (float(x @ x), 2 * x), np.array([3.0, -4.0]))
    >>> space.start()
    >>> _minimize_cg(space, gtol=1e-5, ftol=0.0, maxiter=10, maxfev=100, restart_every=2)
    (True, 'gradient inf-norm <= gtol')
    """
    st = space.state
    if st.g_inf <= gtol:
        return True, "gradient inf-norm <= gtol at x0"
    (gg,) = space.run([("dot", st.g, st.g)])
    since_restart = 0
    f_prev = st.f + math.sqrt(gg) / 2.0  # SciPy's first-iteration guess: the step becomes ~1/||g||
    # SciPy caps every initial step at 1: with a gradient far below 1 (F scaled down) no trial then moves
    # x by more than |g|. The cap widens to 1/||g_0|| (L-BFGS-B's first step, one unit along -g_0), and
    # the line search's own with it; for ||g_0|| >= 1 both stay SciPy's.
    max_step = max(1.0, 1.0 / math.sqrt(gg)) if gg > 0.0 else 1.0
    stpmax = LBFGSB_STPMAX * max_step
    # Every op rides on an evaluation, as in L-BFGS: the direction update and g.d on the first trial's
    # setup, the new gradient's dots on each trial's gradient. Until the first trial is back, the
    # coordinator knows g.d from scalars (g.(-g + beta*d) = -g.g + beta*g.d_old), enough for its step.
    direction_op: tuple[Any, ...] = ("lincomb", "d", [-1.0], [st.g])
    gd_guess = -gg
    while True:
        g_trial = other_buffer(st.g)
        found = wolfe_search(
            space, step=interpolated_initial_step(st.f, f_prev, gd_guess, max_step=max_step),
            setup=[direction_op], speculate=[("dots", [(g_trial, g_trial), (g_trial, st.g)])],
            maxfev=maxfev, c1=CG_C1, c2=CG_C2, stpmax=stpmax, max_evals=maxls,
        )  # fmt: skip
        if found.over_budget:
            return False, "maximum number of function evaluations reached"
        res = found.result
        if res is None or not res.ok:
            if since_restart > 0:
                direction_op, gd_guess, since_restart = ("lincomb", "d", [-1.0], [st.g]), -gg, 0
                continue
            return False, f"line search failed: {res.message if res else 'not a descent direction'}"
        (g1g1, g1g0), g1d = found.last.extra[-1], found.last.gd
        g_old_sq = gg
        f_prev = accept_trial(st, found.last)
        gg = g1g1
        close_iteration(space, res.step, callback, [st.x, st.g])
        stop = stop_test(st, f_prev, gtol=gtol, ftol=ftol, maxiter=maxiter)
        if stop is not None:
            return stop
        beta, restart = polak_ribiere_plus(
            g1g1, g1g0, g_old_sq, g1d, since_restart=since_restart + 1, restart_every=restart_every
        )
        direction_op, gd_guess = ("lincomb", "d", [-1.0, beta], [st.g, "d"]), -g1g1 + beta * g1d
        since_restart = 0 if restart else since_restart + 1
