"""Batch gradient descent with Armijo backtracking, for Sandblaster (DistBelief, section 4.2).

The simplest of the batch methods the paper's Sandblaster framework hosts: ``x <- x - t*g`` with ``t`` from
:class:`sandblaster._linesearch.ArmijoBacktracking` (Nocedal & Wright, *Numerical Optimization*, 2nd ed.,
Algorithm 3.1), which shrinks the step on each rejected trial. Each search starts at the Barzilai-Borwein
step ``s.y / y.y`` (Barzilai & Borwein, "Two-point step size gradient methods", IMA J. Numer. Anal. 8,
1988), from two dot products of the new gradient; where that is undefined, at the last step times
``grow``. The coordinator needs ``g.g`` (for ``phi'(0) = -g.g``), ``g_new.g`` and ``F`` at each trial
point; the shards do ``x + t*(-g)``. :func:`_minimize_gd` is written once against
:class:`sandblaster._space.ParameterSpace`.
"""

from __future__ import annotations

from collections.abc import Callable

from ._linesearch import (
    ArmijoBacktracking,
)
from ._space import (
    IterationRecord,
    ParameterSpace,
    accept_trial,
    close_iteration,
    other_buffer,
    stop_test,
)

__all__ = ["_minimize_gd"]


def _minimize_gd(
    space: ParameterSpace,
    *,
    gtol: float,
    ftol: float,
    maxiter: int,
    maxfev: int,
    step: float = 1.0,
    maxls: int = 30,
    callback: Callable[[IterationRecord], None] | None = None,
) -> tuple[bool, str]:
    """Gradient descent with Armijo backtracking in ``space``.

    Parameters
    ----------
    space : ParameterSpace
        Started (``state.f``, ``state.g_inf`` hold ``F`` at ``state.x``).
    gtol, ftol, maxiter, maxfev : float, float, int, int
        Stop on ``max|g_i| <= gtol``, a relative decrease ``<= ftol``, or after ``maxiter`` steps or
        ``maxfev`` evaluations.
    step, maxls : float, int
        The first trial step and the trials of one search (``step`` and ``max_evals`` of
        :class:`sandblaster._linesearch.ArmijoBacktracking`; its other options keep their defaults).
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
    >>> _minimize_gd(space, gtol=1e-5, ftol=0.0, maxiter=10, maxfev=100, step=0.5)
    (True, 'gradient inf-norm <= gtol')
    """
    st = space.state
    if st.g_inf <= gtol:
        return True, "gradient inf-norm <= gtol at x0"
    search = ArmijoBacktracking(step=step, max_evals=maxls)
    (gg,) = space.run([("dot", st.g, st.g)])
    while True:
        search.start(st.f, -gg)
        x_trial, g_trial = other_buffer(st.x), other_buffer(st.g)
        # d = -g rides on the first trial's setup; g_t.g_t and g_t.g (the next g.g, and the Barzilai-Borwein
        # step) on every trial's gradient: an iteration costs the coordinator no round trip of its own.
        prefix = [("lincomb", "d", [-1.0], [st.g])]
        suffix = [("dots", [(g_trial, g_trial), (g_trial, st.g)])]
        res = search.result  # already failed if -g.g is not a finite negative slope
        while res is None:
            trial = space.evaluate(
                x_trial, g_trial, prefix_ops=prefix, suffix_ops=suffix, base=st.x, step=search.step,
                direction="d",
            )  # fmt: skip
            prefix = []
            if st.nfev > maxfev:
                return False, "maximum number of function evaluations reached"
            res = search.tell(trial.f)
        if not res.ok:
            return False, f"line search failed: {res.message}"
        f_old = accept_trial(st, trial)
        g1g1, g1g0 = trial.extra[-1]
        # Barzilai & Borwein (1988): with s = -t*g and y = g_new - g, start the next search at s.y / y.y
        # (their second step, the safer one under a monotone search; ~10x fewer iterations than the grown
        # step on logistic regression); the Armijo test still guards every step. Without curvature along s
        # (s.y <= 0) keep the grown step.
        sy = res.step * (gg - g1g0)
        yy = g1g1 - 2.0 * g1g0 + gg
        if sy > 0.0 and yy > 0.0:
            search.step_size = min(sy / yy, search.max_step)
        gg = g1g1
        close_iteration(space, res.step, callback, [st.x, st.g])
        stop = stop_test(st, f_old, gtol=gtol, ftol=ftol, maxiter=maxiter)
        if stop is not None:
            return stop
