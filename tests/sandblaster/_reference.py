"""The batch methods run in process (an :class:`InProcessSpace` holding ``fun(x) -> (f, g)``): the oracles
of the distributed runs, which execute the same method code on the shards, and the classic L-BFGS two-loop
recursion, the oracle of :class:`VLBFGSHistory`.

``minimize_<method>_reference(fun_and_grad, x0, **options)`` runs ``_minimize_<method>`` with
:func:`sandblaster.minimize`'s stopping rules as defaults and returns a :class:`ReferenceResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError
from distbelief.sandblaster._cg import _minimize_cg
from distbelief.sandblaster._gd import _minimize_gd
from distbelief.sandblaster._linesearch import LBFGSB_FTOL
from distbelief.sandblaster._owlqn import _minimize_owlqn
from distbelief.sandblaster._space import InProcessSpace
from distbelief.sandblaster._vlbfgs import _minimize_lbfgs

FG = Callable[[np.ndarray], tuple[float, np.ndarray]]


@dataclass(frozen=True)
class ReferenceResult:
    """The final iterate, ``F`` there, iterations, evaluations (the initial one included, as SciPy counts
    them), whether a convergence test stopped the run, and why it stopped."""

    x: np.ndarray
    fun: float
    nit: int
    nfev: int
    success: bool
    message: str


def _run(
    method: Callable[..., tuple[bool, str]],
    fun_and_grad: FG,
    x0: np.ndarray,
    *,
    gtol: float = 1e-5,
    ftol: float = LBFGSB_FTOL,
    maxiter: int = 15000,
    maxfev: int = 15000,
    history: list[float] | None = None,
    **options: Any,
) -> ReferenceResult:
    """``method`` in a started :class:`InProcessSpace`; ``history``, if given, gets ``F(x0)`` and then the
    objective after every accepted step."""
    # The checks minimize's options make before a run (SandblasterOptions).
    if not (gtol >= 0.0 and ftol >= 0.0):
        raise InvalidOptionError(f"gtol and ftol must be >= 0, got gtol={gtol!r}, ftol={ftol!r}")
    if isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1:
        raise InvalidOptionError(f"maxiter must be an int >= 1, got {maxiter!r}")
    space = InProcessSpace(fun_and_grad, x0)
    space.start()
    if history is not None:
        history.append(space.state.f)
        options["callback"] = lambda rec: history.append(rec.objective)
    success, message = method(space, gtol=gtol, ftol=ftol, maxiter=maxiter, maxfev=maxfev, **options)
    st = space.state
    return ReferenceResult(space.vector(st.x).copy(), st.f, st.nit, st.nfev, success, message)


def minimize_lbfgs_reference(
    fun_and_grad: FG, x0: np.ndarray, *, m: int = 10, maxls: int = 20, **options: Any
) -> ReferenceResult:
    """SciPy's ``L-BFGS-B`` without bounds (``maxcor=m``), iterate for iterate."""
    return _run(_minimize_lbfgs, fun_and_grad, x0, m=m, maxls=maxls, **options)


def minimize_owlqn_reference(
    fun_and_grad: FG, x0: np.ndarray, *, l1: float, m: int = 10, maxls: int = 20, **options: Any
) -> ReferenceResult:
    """Minimize ``f(x) + l1 ||x||_1`` (``fun`` is ``F``, the L1 term included)."""
    return _run(_minimize_owlqn, fun_and_grad, x0, l1=l1, m=m, maxls=maxls, **options)


def minimize_cg_reference(
    fun_and_grad: FG, x0: np.ndarray, *, restart_every: int | None = None, maxls: int = 30, **options: Any
) -> ReferenceResult:
    """Polak-Ribière+ CG, restarted every ``restart_every`` iterations (default ``len(x0)``)."""
    n = np.asarray(x0).size if restart_every is None else restart_every
    return _run(_minimize_cg, fun_and_grad, x0, restart_every=n, maxls=maxls, **options)


def minimize_gd_reference(
    fun_and_grad: FG, x0: np.ndarray, *, maxfev: int = 150000, max_evals: int = 40, **options: Any
) -> ReferenceResult:
    """Gradient descent with Armijo backtracking (``max_evals`` trials a search)."""
    return _run(_minimize_gd, fun_and_grad, x0, maxfev=maxfev, maxls=max_evals, **options)


def two_loop_reference(
    g: np.ndarray, s_list: Sequence[np.ndarray], y_list: Sequence[np.ndarray]
) -> np.ndarray:
    """Classic L-BFGS two-loop recursion on vectors: ``d = -H g`` (Nocedal & Wright, Algorithm 7.4).

    Pairs are ordered oldest to newest; ``H_0 = gamma * I`` with ``gamma = s.y / y.y`` of the newest pair,
    and ``d = -g`` without pairs.
    """
    if len(s_list) != len(y_list):
        raise InvalidOptionError(f"need as many s as y vectors, got {len(s_list)} and {len(y_list)}")
    q = np.array(g, dtype=np.float64, copy=True)
    k = len(s_list)
    rho = [1.0 / float(s_list[i] @ y_list[i]) for i in range(k)]
    alpha = [0.0] * k
    for i in range(k - 1, -1, -1):
        alpha[i] = rho[i] * float(s_list[i] @ q)
        q -= alpha[i] * y_list[i]
    if k:
        q *= float(s_list[-1] @ y_list[-1]) / float(y_list[-1] @ y_list[-1])
    for i in range(k):
        beta = rho[i] * float(y_list[i] @ q)
        q += (alpha[i] - beta) * s_list[i]
    return -q
