"""Vector-free OWL-QN: L1 and elastic-net L-BFGS with the coordinator holding scalars only.

OWL-QN (Andrew & Gao, "Scalable training of L1-regularized log-linear models", ICML 2007) minimizes
``F(x) = f(x) + l1 ||x||_1`` for a smooth ``f`` (here the data term plus ``(l2/2)||x||^2``, so ``l2 > 0``
is the elastic net). Each iteration:

1. the pseudo-gradient ``v`` of ``F`` at ``x`` (the gradient ``g`` of ``f``, plus ``l1 sign(x)``, and at
   ``x_i = 0`` the minimum-norm subgradient);
2. the L-BFGS direction ``d = -H v``, with the pairs ``s = x_new - x``, ``y = g_new - g`` of the smooth part
   only, projected onto the signs of ``-v`` (``d_i = 0`` where ``d_i v_i >= 0``);
3. the orthant ``xi = sign(x)``, or ``sign(-v)`` where ``x_i = 0``;
4. a backtracking search along the projected path ``x(t) = pi(x + t d; xi)`` (coordinates leaving the
   orthant are set to 0) until ``F(x(t)) <= F(x) + c1 v.(x(t) - x)``.

The direction is VL-BFGS's (Chen, Wang & Zhou, "Large-scale L-BFGS using MapReduce", NIPS 2014), as in
spark-vlbfgs's VF-OWLQN: :class:`~sandblaster._vlbfgs.VLBFGSHistory` holds the Gram matrix of
``[s_1..s_k, y_1..y_k, v]`` (the pseudo-gradient where L-BFGS has ``g``) and turns it into coefficients; the
shards form ``d`` as a linear combination and run the L1 ops (``pseudo_grad``, ``sign_align``, ``orthant``,
``project_orthant``, ``norm1``, ``nnz``: :mod:`storage._l1`). :func:`_minimize_owlqn` is written once
against :class:`~sandblaster._space.ParameterSpace`; every op rides on an evaluation (the direction, the
orthant, the trial point, ``s``, ``v.s``, ``||x_t||_1`` and the nonzero count on the replicas' fetch; ``y``,
the new pseudo-gradient and the new Gram entries on the last push), so a typical iteration costs the
coordinator no round trip of its own. In an :class:`~sandblaster._space.InProcessSpace` it runs in process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from distbelief.errors import InvalidOptionError

from ._space import (
    Evaluation,
    IterationRecord,
    Op,
    ParameterSpace,
    accept_trial,
    close_iteration,
    other_buffer,
    stop_test,
)
from ._vlbfgs import VLBFGSHistory, _checkpoint_extra, _minimize_lbfgs, history_ops, resumed_history

__all__ = ["OWLQN_C1", "OWLQN_SHRINK", "_minimize_owlqn", "check_l1"]

#: Sufficient-decrease constant of the backtracking search (Andrew & Gao's gamma).
OWLQN_C1 = 1e-4
#: Factor the step shrinks by after a rejected trial (Andrew & Gao's beta).
OWLQN_SHRINK = 0.5


def check_l1(l1: float) -> float:
    """``l1`` as a float, or :class:`~distbelief.errors.InvalidOptionError` unless it is finite and >= 0.

    Examples
    --------
    >>> check_l1(-1.0)
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: l1 must be a finite number >= 0, got -1.0
    """
    if isinstance(l1, bool) or not isinstance(l1, int | float) or not (math.isfinite(l1) and l1 >= 0.0):
        raise InvalidOptionError(f"l1 must be a finite number >= 0, got {l1!r}")
    return float(l1)


def _pseudo(x_name: str) -> str:
    # The pseudo-gradient lives beside x: "va" with "xa", "vb" with "xb".
    return {"xa": "va", "xb": "vb"}[x_name]


class _Trial(NamedTuple):
    """Outcome of :func:`_backtrack`."""

    ok: bool
    over_budget: bool
    message: str
    step: float
    #: The last trial, with ``f = F`` (the L1 term added) and ``g_inf = max|v_t|``.
    last: Evaluation | None
    #: ``v.(x_t - x)`` (``<= 0``), the nonzero count of ``x_t``, the history with ``x_t``'s pair pending,
    #: that pair's slot names and its new Gram entries.
    vs: float = math.nan
    nnz: int = 0
    spec: VLBFGSHistory | None = None
    names: tuple[str, str] = ("", "")
    values: list[float] | None = None


def _backtrack(
    space: ParameterSpace,
    hist: VLBFGSHistory,
    *,
    l1: float,
    step: float,
    maxls: int,
    maxfev: int,
    free: tuple[Any, ...] = (),
    store: tuple[str, ...] = (),
) -> _Trial:
    """Andrew & Gao's backtracking search along the projected path, every op riding on the evaluations."""
    st = space.state
    x, g, v = st.x, st.g, _pseudo(st.x)
    x_t, g_t = other_buffer(x), other_buffer(g)
    coeffs = hist.direction_coefficients()
    setup: list[Op] = [
        ("lincomb", "d", [c for c, _ in coeffs], [n for _, n in coeffs]),
        ("sign_align", "d", v),
        ("orthant", "xi", x, v),
        ("dot", v, "d"),
    ]
    t = step
    for _ in range(maxls):
        spec = hist.copy()
        s_name, y_name = spec.push_pair()
        prefix: list[Op] = [
            *setup,
            ("lincomb", x_t, [1.0, t], [x, "d"]),
            ("project_orthant", x_t, "xi", *free),
            ("lincomb", s_name, [1.0, -1.0], [x_t, x], *store),
            ("dot", v, s_name),
            ("norm1", x_t, *free),
            ("nnz", x_t),
        ]
        suffix: list[Op] = [
            ("lincomb", y_name, [1.0, -1.0], [g_t, g], *store),
            ("pseudo_grad", _pseudo(x_t), g_t, x_t, l1, *free),
            ("norm_inf", _pseudo(x_t)),
            ("dots", spec.dot_requests(_pseudo(x_t))),
        ]
        ev = space.evaluate(x_t, g_t, prefix_ops=prefix, suffix_ops=suffix)
        pre, post = ev.extra[: len(prefix)], ev.extra[len(prefix) :]
        if st.nfev > maxfev:
            return _Trial(False, True, "maximum number of function evaluations reached", t, None)
        if setup:
            if not pre[len(setup) - 1] < 0.0:  # v.d: 0 once the alignment zeroed all of d
                return _Trial(False, False, "the search direction is not a descent direction", t, None)
            setup = []
        vs, x1, count = float(pre[-3]), float(pre[-2]), int(pre[-1])
        f_t, v_inf = ev.f + l1 * x1, float(post[2])
        trial = ev._replace(f=f_t, g_inf=v_inf)
        if math.isfinite(f_t) and math.isfinite(v_inf) and vs < 0.0 and f_t <= st.f + OWLQN_C1 * vs:
            return _Trial(True, False, "", t, trial, vs, count, spec, (s_name, y_name), list(post[3]))
        if vs == 0.0 and math.isfinite(f_t):
            return _Trial(False, False, "line search failed: the step no longer moves x", t, trial)
        t *= OWLQN_SHRINK
    return _Trial(False, False, f"line search failed: no sufficient decrease in {maxls} trials", t, None)


def _minimize_owlqn(
    space: ParameterSpace,
    *,
    l1: float,
    m: int,
    gtol: float,
    ftol: float,
    maxiter: int,
    maxfev: int,
    maxls: int = 20,
    callback: Callable[[IterationRecord], None] | None = None,
    resume: Mapping[str, Any] | None = None,
    l1_exclude: Sequence[tuple[int, int]] = (),
    history_dtype: str = "float64",
) -> tuple[bool, str]:
    """Vector-free OWL-QN in ``space``: minimize ``F(x) = f(x) + l1 ||x||_1`` (Andrew & Gao 2007).

    ``space`` evaluates the smooth ``f`` and its gradient; ``state.f`` becomes ``F`` and ``state.g_inf``
    the pseudo-gradient's ``max|v_i|``, which is what the stopping rules (``max|v_i| <= gtol``, a relative
    decrease of ``F`` ``<= ftol``, ``maxiter``) test. Each record's ``nnz`` is the nonzero count of its
    iterate. After a failed search the memory is dropped and the search retried along ``-v`` (the run
    fails if the memory was already empty). With ``l1 = 0`` there is no nonsmooth term and this is
    :func:`~sandblaster._vlbfgs._minimize_lbfgs` (strong Wolfe search), iterate for iterate.

    On the shards the first iteration asks for the pseudo-gradient at ``x0`` and its dots in one round
    trip of its own (so does the one after a reset); every other op rides on the evaluations.

    Parameters
    ----------
    space : ParameterSpace
        Started (``state.f`` holds ``f`` at ``state.x``, without the L1 term).
    l1 : float
        L1 strength (``>= 0``).
    m : int
        Memory size.
    gtol, ftol, maxiter, maxfev, maxls : float, float, int, int, int
        Stopping rules, the evaluation budget and the trials of one backtracking search.
    callback : callable, optional
        Called with each iteration's record.
    resume : mapping, optional
        The metadata of a checkpoint of this method to continue from.
    l1_exclude : sequence of (start, stop)
        Ranges of ``x`` the L1 term leaves out (intercepts): there the pseudo-gradient is the gradient and
        the step is not projected (``storage._l1``'s ``free``).
    history_dtype : {"float64", "float32"}
        How the pairs are stored (as in :func:`~sandblaster._vlbfgs._minimize_lbfgs`).

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
    >>> space = InProcessSpace(lambda x: (float((x - 3) @ (x - 3)), 2 * (x - 3)), np.array([0.0, 0.0]))
    >>> space.start()
    >>> _minimize_owlqn(space, l1=2.0, m=5, gtol=1e-9, ftol=0.0, maxiter=50, maxfev=500)[0]
    True
    >>> space.vector(space.state.x), space.state.f     # argmin (x-3)^2 + 2|x| per coordinate: x = 2
    (array([2., 2.]), 10.0)
    """
    l1 = check_l1(l1)
    store = history_ops(history_dtype)
    # The ops carry the ranges only when there are some: the messages of a plain run stay as they were.
    free: tuple[Any, ...] = (tuple((int(a), int(b)) for a, b in l1_exclude),) if l1_exclude else ()
    if l1 == 0.0:
        return _minimize_lbfgs(
            space, m=m, gtol=gtol, ftol=ftol, maxiter=maxiter, maxfev=maxfev, maxls=maxls,
            callback=callback, resume=resume, history_dtype=history_dtype,
        )  # fmt: skip
    st = space.state
    hist = VLBFGSHistory(m, prefix="h")
    pending: tuple[VLBFGSHistory, list[float], float | None] | None
    if resume is None:
        v = _pseudo(st.x)
        _, v_inf, x1, count, values = space.run(
            [("pseudo_grad", v, st.g, st.x, l1, *free), ("norm_inf", v), ("norm1", st.x, *free),
             ("nnz", st.x),
             ("dots", hist.dot_requests(v))]
        )  # fmt: skip
        st.f, st.g_inf = st.f + l1 * float(x1), float(v_inf)
        first = st.records[-1]
        first.objective, first.grad_norm, first.nnz = st.f, st.g_inf, int(count)
        if st.g_inf <= gtol:
            return True, "pseudo-gradient inf-norm <= gtol at x0"
        pending = (hist, list(values), None)
    else:
        pending = resumed_history(resume, m, history_dtype)
    while True:
        descent: float | None = None
        if pending is None:
            values = space.run([("dots", hist.dot_requests(_pseudo(st.x)))])[0]
        else:
            hist, values, descent = pending
            pending = None
        hist.update_dots(values, descent=descent)
        # Without pairs d = -v (the alignment keeps all of it): scale the first trial to move x by one unit.
        vv = hist.dot_matrix()[-1, -1]
        step = 1.0 / math.sqrt(vv) if hist.n_pairs == 0 and vv > 0.0 else 1.0
        found = _backtrack(space, hist, l1=l1, step=step, maxls=maxls, maxfev=maxfev, free=free, store=store)
        if found.over_budget:
            return False, found.message
        if not found.ok:
            if hist.n_pairs:
                hist.reset()  # as L-BFGS-B: back to x, drop the memory, retry along -v
                continue
            return False, found.message
        assert found.last is not None and found.spec is not None and found.values is not None
        pending = (found.spec, found.values, -found.vs)
        f_old = accept_trial(st, found.last)
        kept = [name for names in found.spec.pair_names for name in names]
        close_iteration(
            space, found.step, callback, [st.x, st.g, _pseudo(st.x), *kept, *found.names],
            _checkpoint_extra(found.spec, found.values, -found.vs, history_dtype), {"nnz": found.nnz},
        )  # fmt: skip
        stop = stop_test(st, f_old, gtol=gtol, ftol=ftol, maxiter=maxiter)
        if stop is not None:
            return stop
