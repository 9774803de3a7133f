"""Scalar-driven line searches and stopping rules for Sandblaster's batch methods (DistBelief, section 4.2).

In Sandblaster the coordinator never holds a vector: a trial point ``x + t*d`` is formed on the
parameter-server shards, and only ``phi(t) = F(x + t*d)`` and ``phi'(t) = grad F(x + t*d) . d`` come back.
The line searches here are therefore *state machines over scalars*: ask for the next trial step, feed back
``(phi, dphi)``, repeat until a :class:`LineSearchResult` comes out.

:class:`StrongWolfeLineSearch` is a port of MINPACK-2's ``dcsrch``/``dcstep`` (Moré & Thuente, "Line search
algorithms with guaranteed sufficient decrease", ACM TOMS 20(3), 1994), following SciPy's Python port
(``scipy/optimize/_dcsrch.py``, SciPy 1.17). It is the line search of L-BFGS-B (``lnsrlb`` in
``scipy/optimize/src/lbfgsb``), so the L-BFGS built on it takes the same steps as SciPy's
``L-BFGS-B`` on unconstrained problems. :class:`ArmijoBacktracking` is the simple sufficient-decrease
search of Nocedal & Wright, *Numerical Optimization* (2nd ed.), Algorithm 3.1, with a step that grows
after a success so plain gradient descent does not stay stuck with a tiny step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from distbelief.errors import InvalidOptionError, ProtocolError

__all__ = [
    "LBFGSB_C1",
    "LBFGSB_C2",
    "LBFGSB_FTOL",
    "LBFGSB_STPMAX",
    "LBFGSB_XTOL",
    "ArmijoBacktracking",
    "LineSearchResult",
    "LineSearchStatus",
    "StrongWolfeLineSearch",
    "interpolated_initial_step",
    "lbfgsb_initial_step",
    "relative_reduction_converged",
]

#: Constants of L-BFGS-B's ``lnsrlb`` (the values its ``dcsrch`` call uses). L-BFGS-B deliberately uses
#: a sufficient-decrease constant of 1e-3, not the textbook 1e-4.
LBFGSB_C1 = 1e-3
LBFGSB_C2 = 0.9
LBFGSB_XTOL = 0.1
#: Upper bound on the step of an unconstrained L-BFGS-B line search.
LBFGSB_STPMAX = 1e10
#: SciPy's default ``ftol`` for L-BFGS-B (``factr = 1e7`` times machine epsilon).
LBFGSB_FTOL = 1e7 * float(np.finfo(np.float64).eps)

LineSearchStatus = Literal["converged", "warning", "failed"]

# dcsrch's extrapolation factors and bisection trigger (MINPACK-2 names in comments).
_XTRAPL = 1.1  # xtrapl
_XTRAPU = 4.0  # xtrapu
_P66 = 0.66  # p66: bisect when the bracket did not shrink by this factor


@dataclass(frozen=True)
class LineSearchResult:
    """Outcome of a line search.

    Attributes
    ----------
    status : {"converged", "warning", "failed"}
        ``"converged"``: the step satisfies the requested conditions. ``"warning"``: the search could not
        satisfy them (rounding errors, bracket below ``xtol``, step at a bound) but returns the best point
        it found; L-BFGS-B accepts such a step and lets its stopping tests decide. ``"failed"``: no usable
        step (evaluation budget exhausted, not a descent direction, non-finite values).
    step : float
        The accepted step ``t`` (for ``"failed"``: the best step seen, possibly 0).
    phi : float
        ``F(x + step*d)``.
    dphi : float or None
        ``grad F(x + step*d) . d`` when it was evaluated (``None`` for searches that only use ``phi``).
    is_last_evaluated : bool
        True when ``step`` is the last trial point the caller evaluated, so the shards already hold the
        right ``x`` and gradient; otherwise the caller must re-form ``x + step*d`` (and its gradient).
    n_evals : int
        Number of ``(phi, dphi)`` evaluations fed to the search.
    message : str
        Human-readable reason.

    Examples
    --------
    >>> r = LineSearchResult("converged", 0.5, 1.0, -0.1, True, 2, "strong Wolfe conditions hold")
    >>> r.ok
    True
    """

    status: LineSearchStatus
    step: float
    phi: float
    dphi: float | None
    is_last_evaluated: bool
    n_evals: int
    message: str

    @property
    def ok(self) -> bool:
        """Whether the step may be taken (``"converged"`` or ``"warning"``)."""
        return self.status != "failed"


def relative_reduction_converged(f_old: float, f_new: float, *, ftol: float) -> bool:
    """SciPy L-BFGS-B's objective test ``(f_old - f_new) / max(|f_old|, |f_new|, 1) <= ftol``.

    Written multiplied out, as in L-BFGS-B, so it is safe for ``f`` near zero.

    Examples
    --------
    >>> relative_reduction_converged(1.0, 1.0 - 1e-12, ftol=1e-9)
    True
    >>> relative_reduction_converged(1.0, 0.5, ftol=1e-9)
    False
    """
    return (f_old - f_new) <= ftol * max(abs(f_old), abs(f_new), 1.0)


def lbfgsb_initial_step(iteration: int, d_norm: float, *, stpmax: float = LBFGSB_STPMAX) -> float:
    """First trial step of L-BFGS-B's line search (``lnsrlb``).

    ``min(1/||d||, stpmax)`` on the very first iteration (the direction is then ``-g``, whose length says
    nothing about a good step), ``1`` afterwards (the quasi-Newton step is well scaled). Iterations
    count accepted steps, so a restart after a failed line search keeps ``1``, as L-BFGS-B does.

    Examples
    --------
    >>> lbfgsb_initial_step(0, 4.0), lbfgsb_initial_step(3, 4.0)
    (0.25, 1.0)
    """
    if iteration == 0:
        if not d_norm > 0.0:
            raise InvalidOptionError(f"d_norm must be > 0 for the first step, got {d_norm!r}")
        return min(1.0 / d_norm, stpmax)
    return 1.0


def interpolated_initial_step(phi0: float, phi_prev: float, dphi0: float, *, max_step: float = 1.0) -> float:
    """Initial step from the last decrease, ``min(max_step, 1.01 * 2 * (phi0 - phi_prev) / dphi0)``.

    Nocedal & Wright (3.60): assume the first-order change this iteration equals the last one. SciPy's CG
    and BFGS use the same guess; on the first iteration pass ``phi_prev = phi0 + ||g|| / 2`` as SciPy
    does. Falls back to ``max_step`` when the guess is not a positive finite number.

    Examples
    --------
    >>> interpolated_initial_step(1.0, 2.0, -4.0)
    0.505
    """
    if dphi0 == 0.0:
        return max_step
    guess = 1.01 * 2.0 * (phi0 - phi_prev) / dphi0
    if not (math.isfinite(guess) and guess > 0.0):
        return max_step
    return min(max_step, guess)


def _sign(v: float) -> float:
    return 0.0 if v == 0.0 else math.copysign(1.0, v)


def _div(a: float, b: float) -> float:
    """IEEE division (Fortran semantics): x/0 gives +-inf or nan instead of raising."""
    if b != 0.0:
        return a / b
    if a == 0.0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _cubic_gamma(theta: float, da: float, db: float, s: float) -> float:
    r = _div(theta, s) ** 2 - _div(da, s) * _div(db, s)
    if math.isnan(r):
        return math.nan
    # max(0, .) guards against rounding making the radicand slightly negative; MINPACK would return NaN.
    return s * math.sqrt(max(r, 0.0))


def _dcstep(
    stx: float,
    fx: float,
    dx: float,
    sty: float,
    fy: float,
    dy: float,
    stp: float,
    fp: float,
    dp: float,
    brackt: bool,
    stpmin: float,
    stpmax: float,
) -> tuple[float, float, float, float, float, float, float, bool]:
    """MINPACK-2 ``dcstep``: safeguarded cubic/quadratic step and update of the bracketing interval.

    A line-by-line port of SciPy's ``_dcsrch.dcstep``; see Moré & Thuente (1994), section 4.
    """
    sgnd = _sign(dp) * _sign(dx)
    if fp > fx:
        # Case 1: higher function value; the minimum is bracketed. Take the cubic step if it is closer to
        # stx than the quadratic step, otherwise their average.
        theta = 3.0 * _div(fx - fp, stp - stx) + dx + dp
        s = max(abs(theta), abs(dx), abs(dp))
        gamma = _cubic_gamma(theta, dx, dp, s)
        if stp < stx:
            gamma = -gamma
        p = (gamma - dx) + theta
        q = ((gamma - dx) + gamma) + dp
        r = _div(p, q)
        stpc = stx + r * (stp - stx)
        stpq = stx + (_div(dx, _div(fx - fp, stp - stx) + dx) / 2.0) * (stp - stx)
        stpf = stpc if abs(stpc - stx) <= abs(stpq - stx) else stpc + (stpq - stpc) / 2.0
        brackt = True
    elif sgnd < 0.0:
        # Case 2: lower value, derivatives of opposite sign; bracketed. Cubic if farther than secant.
        theta = 3.0 * _div(fx - fp, stp - stx) + dx + dp
        s = max(abs(theta), abs(dx), abs(dp))
        gamma = _cubic_gamma(theta, dx, dp, s)
        if stp > stx:
            gamma = -gamma
        p = (gamma - dp) + theta
        q = ((gamma - dp) + gamma) + dx
        r = _div(p, q)
        stpc = stp + r * (stx - stp)
        stpq = stp + _div(dp, dp - dx) * (stx - stp)
        stpf = stpc if abs(stpc - stp) > abs(stpq - stp) else stpq
        brackt = True
    elif abs(dp) < abs(dx):
        # Case 3: lower value, same-sign derivatives, derivative magnitude decreases. The cubic step is
        # used only if the cubic tends to infinity in the direction of the step or its minimum lies beyond
        # stp; otherwise the secant step.
        theta = 3.0 * _div(fx - fp, stp - stx) + dx + dp
        s = max(abs(theta), abs(dx), abs(dp))
        gamma = _cubic_gamma(theta, dx, dp, s)
        if stp > stx:
            gamma = -gamma
        p = (gamma - dp) + theta
        q = (gamma + (dx - dp)) + gamma
        r = _div(p, q)
        if r < 0.0 and gamma != 0.0:
            stpc = stp + r * (stx - stp)
        elif stp > stx:
            stpc = stpmax
        else:
            stpc = stpmin
        stpq = stp + _div(dp, dp - dx) * (stx - stp)
        if brackt:
            stpf = stpc if abs(stpc - stp) < abs(stpq - stp) else stpq
            # Do not go more than 66% of the way to sty (keeps the bracket shrinking).
            bound = stp + _P66 * (sty - stp)
            stpf = min(bound, stpf) if stp > stx else max(bound, stpf)
        else:
            stpf = stpc if abs(stpc - stp) > abs(stpq - stp) else stpq
            stpf = min(max(stpf, stpmin), stpmax)
    else:
        # Case 4: lower value, same-sign derivatives, derivative magnitude does not decrease.
        if brackt:
            theta = 3.0 * _div(fp - fy, sty - stp) + dy + dp
            s = max(abs(theta), abs(dy), abs(dp))
            gamma = _cubic_gamma(theta, dy, dp, s)
            if stp > sty:
                gamma = -gamma
            p = (gamma - dp) + theta
            q = ((gamma - dp) + gamma) + dy
            r = _div(p, q)
            stpf = stp + r * (sty - stp)
        elif stp > stx:
            stpf = stpmax
        else:
            stpf = stpmin

    # Update the interval that contains a minimizer.
    if fp > fx:
        sty, fy, dy = stp, fp, dp
    else:
        if sgnd < 0.0:
            sty, fy, dy = stx, fx, dx
        stx, fx, dx = stp, fp, dp
    return stx, fx, dx, sty, fy, dy, stpf, brackt


class _SearchState:
    """What both line searches expose while they run (private): ``done``, ``result``, ``step``.

    A subclass keeps its next trial step in ``_stp`` and its outcome in ``_result`` (``None`` while the
    current search goes on).
    """

    _stp: float
    _result: LineSearchResult | None

    @property
    def done(self) -> bool:
        """Whether the current search has ended (read :attr:`result`)."""
        return self._result is not None

    @property
    def result(self) -> LineSearchResult | None:
        """The outcome of the current search once :attr:`done`, else ``None``."""
        return self._result

    @property
    def step(self) -> float:
        """The next trial step to evaluate (the accepted step once done)."""
        return self._stp if self._result is None else self._result.step


class StrongWolfeLineSearch(_SearchState):
    """Moré-Thuente line search for the strong Wolfe conditions, as a state machine over scalars.

    Finds ``t`` with ``phi(t) <= phi(0) + c1*t*phi'(0)`` and ``|phi'(t)| <= c2*|phi'(0)|`` where
    ``phi(t) = F(x + t*d)``. Port of MINPACK-2 ``dcsrch`` (Moré & Thuente 1994) following SciPy's
    ``scipy/optimize/_dcsrch.py``; parameter names map as ``c1 = ftol``, ``c2 = gtol``. One addition: a
    non-finite ``phi``/``dphi`` (overflow far along ``d``) is not fed to the interpolation; the search caps
    the step halfway back to the best point and continues.

    Parameters
    ----------
    phi0, dphi0 : float
        ``F(x)`` and ``grad F(x) . d``. ``dphi0`` must be negative (a descent direction); otherwise the
        search ends at once with status ``"failed"``.
    step : float
        First trial step (1 for quasi-Newton directions; see :func:`lbfgsb_initial_step`).
    c1, c2 : float
        Sufficient-decrease and curvature constants, ``0 < c1 < c2 < 1``. Use ``c2 = 0.9`` for
        quasi-Newton methods, ``0.1`` for nonlinear CG; L-BFGS-B itself uses ``c1 = 1e-3``.
    xtol : float
        Relative width below which the bracket is considered too small (warning).
    stpmin, stpmax : float
        Bounds on the step.
    max_evals : int
        Evaluation budget (L-BFGS-B's ``maxls``, 20).

    Notes
    -----
    Protocol: while ``not search.done``, evaluate ``phi`` and ``phi'`` at ``search.step`` and call
    ``search.tell(phi, dphi)``. The returned :class:`LineSearchResult` (also ``search.result``) tells
    whether the last evaluated point is the accepted one; for ``"converged"`` and ``"warning"`` it always
    is, because ``dcsrch`` asks for the best point again before giving up.

    Examples
    --------
    >>> phi = lambda t: (t - 2.0) ** 2          # F along d, minimum at t = 2
    >>> dphi = lambda t: 2.0 * (t - 2.0)
    >>> ls = StrongWolfeLineSearch(phi(0.0), dphi(0.0), step=8.0)   # overshoots; interpolation fixes it
    >>> while not ls.done:
    ...     t = ls.step
    ...     _ = ls.tell(phi(t), dphi(t))
    >>> ls.result.status, ls.result.step, ls.result.n_evals
    ('converged', 2.0, 2)
    """

    def __init__(
        self,
        phi0: float,
        dphi0: float,
        *,
        step: float = 1.0,
        c1: float = 1e-4,
        c2: float = 0.9,
        xtol: float = LBFGSB_XTOL,
        stpmin: float = 0.0,
        stpmax: float = LBFGSB_STPMAX,
        max_evals: int = 20,
    ) -> None:
        if not (0.0 < c1 < c2 < 1.0):
            raise InvalidOptionError(f"need 0 < c1 < c2 < 1, got c1={c1!r}, c2={c2!r}; try c1=1e-4, c2=0.9")
        if not (math.isfinite(xtol) and xtol >= 0.0):
            raise InvalidOptionError(f"xtol must be a finite number >= 0, got {xtol!r}; try 0.1")
        if not (math.isfinite(stpmin) and 0.0 <= stpmin < stpmax):
            raise InvalidOptionError(f"need 0 <= stpmin < stpmax, got stpmin={stpmin!r}, stpmax={stpmax!r}")
        if not (math.isfinite(step) and step > 0.0 and stpmin <= step <= stpmax):
            raise InvalidOptionError(
                f"step must be positive and within [stpmin, stpmax] = [{stpmin}, {stpmax}], got {step!r}"
            )
        if isinstance(max_evals, bool) or not isinstance(max_evals, int) or max_evals < 1:
            raise InvalidOptionError(f"max_evals must be an int >= 1, got {max_evals!r}; try 20")
        self.c1 = float(c1)
        self.c2 = float(c2)
        self.xtol = float(xtol)
        self.stpmin = float(stpmin)
        self.stpmax = float(stpmax)
        self.max_evals = max_evals
        self.phi0 = float(phi0)
        self.dphi0 = float(dphi0)
        self.n_evals = 0
        self._result: LineSearchResult | None = None
        self._stp = float(step)
        if not (math.isfinite(self.phi0) and math.isfinite(self.dphi0)):
            self._finish("failed", 0.0, self.phi0, self.dphi0, False, "phi(0) or phi'(0) is not finite")
            return
        if self.dphi0 >= 0.0:
            self._finish(
                "failed", 0.0, self.phi0, self.dphi0, False,
                f"not a descent direction: phi'(0) = {self.dphi0!r} >= 0",
            )  # fmt: skip
            return
        # dcsrch 'START': stx/fx/gx is the best step so far, sty/fy/gy the other end of the interval.
        self._brackt = False
        self._stage = 1
        self._gtest = self.c1 * self.dphi0
        self._width = self.stpmax - self.stpmin
        self._width1 = self._width / 0.5
        self._stx, self._fx, self._gx = 0.0, self.phi0, self.dphi0
        self._sty, self._fy, self._gy = 0.0, self.phi0, self.dphi0
        self._stmin = 0.0
        self._stmax = self._stp + _XTRAPU * self._stp
        # Open interval of steps known to give finite values (see _non_finite).
        self._bad_lo = -math.inf
        self._bad_hi = math.inf

    def _finish(
        self, status: LineSearchStatus, step: float, phi: float, dphi: float | None, last: bool, message: str
    ) -> LineSearchResult:
        self._result = LineSearchResult(status, step, phi, dphi, last, self.n_evals, message)
        return self._result

    def tell(self, phi: float, dphi: float) -> LineSearchResult | None:
        """Feed ``phi(step)`` and ``phi'(step)`` for the current :attr:`step`.

        Parameters
        ----------
        phi, dphi : float
            ``F(x + step*d)`` and ``grad F(x + step*d) . d``.

        Returns
        -------
        LineSearchResult or None
            The outcome if the search has ended, else ``None`` (evaluate the new :attr:`step`).
        """
        if self._result is not None:
            raise ProtocolError("the line search has already ended; start a new one for the next iteration")
        self.n_evals += 1
        stp, f, g = self._stp, float(phi), float(dphi)
        if not (math.isfinite(f) and math.isfinite(g)):
            return self._non_finite(stp)

        ftest = self.phi0 + stp * self._gtest
        if self._stage == 1 and f <= ftest and g >= 0.0:
            self._stage = 2

        # Warnings, then convergence, exactly in dcsrch's order (a later test overrides an earlier one).
        status: LineSearchStatus | None = None
        message = ""
        if self._brackt and (stp <= self._stmin or stp >= self._stmax):
            status, message = "warning", "rounding errors prevent progress"
        if self._brackt and self._stmax - self._stmin <= self.xtol * self._stmax:
            status, message = "warning", "xtol test satisfied"
        if stp == self.stpmax and f <= ftest and g <= self._gtest:
            status, message = "warning", "step is at stpmax"
        if stp == self.stpmin and (f > ftest or g >= self._gtest):
            status, message = "warning", "step is at stpmin"
        if f <= ftest and abs(g) <= self.c2 * -self.dphi0:
            status, message = "converged", "strong Wolfe conditions hold"
        if status is not None:
            return self._finish(status, stp, f, g, True, message)
        if self.n_evals >= self.max_evals:
            message = f"no step satisfying the strong Wolfe conditions in {self.max_evals} evaluations"
            # Report the best point, the one dcstep would keep as stx (ties go to the newer point).
            if f <= self._fx:
                return self._finish("failed", stp, f, g, True, message)
            return self._finish("failed", self._stx, self._fx, self._gx, False, message)

        if self._stage == 1 and f <= self._fx and f > ftest:
            # Stage 1 with a lower value but insufficient decrease: interpolate the modified function
            # psi(t) = phi(t) - phi(0) - c1*t*phi'(0) (Moré & Thuente, section 3).
            gt = self._gtest
            stx, fxm, gxm, sty, fym, gym, stp, self._brackt = _dcstep(
                self._stx, self._fx - self._stx * gt, self._gx - gt,
                self._sty, self._fy - self._sty * gt, self._gy - gt,
                stp, f - stp * gt, g - gt, self._brackt, self._stmin, self._stmax,
            )  # fmt: skip
            self._stx, self._sty = stx, sty
            self._fx, self._fy = fxm + stx * gt, fym + sty * gt
            self._gx, self._gy = gxm + gt, gym + gt
        else:
            (self._stx, self._fx, self._gx, self._sty, self._fy, self._gy, stp, self._brackt) = _dcstep(
                self._stx, self._fx, self._gx, self._sty, self._fy, self._gy,
                stp, f, g, self._brackt, self._stmin, self._stmax,
            )  # fmt: skip

        if self._brackt:
            # Bisect when the bracket did not shrink enough over the last two steps.
            if abs(self._sty - self._stx) >= _P66 * self._width1:
                stp = self._stx + 0.5 * (self._sty - self._stx)
            self._width1 = self._width
            self._width = abs(self._sty - self._stx)
            self._stmin = min(self._stx, self._sty)
            self._stmax = max(self._stx, self._sty)
        else:
            self._stmin = stp + _XTRAPL * (stp - self._stx)
            self._stmax = stp + _XTRAPU * (stp - self._stx)
        stp = min(max(stp, self.stpmin), self.stpmax)
        # If no further progress is possible, ask for the best point again; the next call then warns.
        if self._brackt and (
            stp <= self._stmin or stp >= self._stmax or self._stmax - self._stmin <= self.xtol * self._stmax
        ):
            stp = self._stx
        if not math.isfinite(stp):
            return self._finish(
                "failed", self._stx, self._fx, self._gx, self._stx == self._stp,
                "the interpolated step is not finite (rounding errors)",
            )  # fmt: skip
        if not self._bad_lo < stp < self._bad_hi:
            # Never go back to (or beyond) a step where phi was not finite.
            bound = self._bad_hi if stp >= self._bad_hi else self._bad_lo
            stp = self._stx + 0.5 * (bound - self._stx)
        self._stp = stp
        return None

    def _non_finite(self, stp: float) -> LineSearchResult | None:
        # Not part of dcsrch: an overflow far along d must not poison the cubic fits. Remember the bad step
        # as a bound that later trials must stay strictly inside, and retry halfway back to the best point.
        if stp > self._stx:
            self._bad_hi = min(self._bad_hi, stp)
        else:
            self._bad_lo = max(self._bad_lo, stp)
        new = self._stx + 0.5 * (stp - self._stx)
        if self.n_evals >= self.max_evals or new in (self._stx, stp):
            return self._finish(
                "failed", self._stx, self._fx, self._gx, False,
                f"phi or phi' is not finite at step {stp!r} and no further trial is possible",
            )  # fmt: skip
        self._stp = new
        return None


class ArmijoBacktracking(_SearchState):
    """Backtracking line search for the Armijo condition, kept across iterations as a scalar state machine.

    Each search starts from the current step size, halves it (``shrink``) until
    ``phi(t) <= phi(0) + c1*t*phi'(0)`` (Nocedal & Wright, Algorithm 3.1), and after a success multiplies
    the step by ``grow`` for the next iteration, so a too-cautious step recovers. Only ``phi`` is needed at
    trial points.

    Parameters
    ----------
    step : float
        Initial step size.
    c1 : float
        Sufficient-decrease constant, in (0, 1).
    shrink : float
        Factor in (0, 1) applied after a rejected trial.
    grow : float
        Factor >= 1 applied to the accepted step for the next search.
    max_evals : int
        Trials per search before it fails.
    max_step : float
        Cap on the step.

    Examples
    --------
    >>> phi = lambda t: (1.0 - t) ** 2            # phi(0) = 1, phi'(0) = -2, minimum at t = 1
    >>> ls = ArmijoBacktracking(step=4.0)
    >>> t = ls.start(phi(0.0), -2.0)              # tries 4, 2, then accepts 1
    >>> while not ls.done:
    ...     _ = ls.tell(phi(ls.step))
    >>> ls.result.step, ls.step_size              # accepted 1.0, next search starts at 2.0
    (1.0, 2.0)
    """

    def __init__(
        self,
        *,
        step: float = 1.0,
        c1: float = 1e-4,
        shrink: float = 0.5,
        grow: float = 2.0,
        max_evals: int = 40,
        max_step: float = 1e10,
    ) -> None:
        if not (math.isfinite(step) and 0.0 < step <= max_step):
            raise InvalidOptionError(f"step must be in (0, max_step={max_step}], got {step!r}")
        if not 0.0 < c1 < 1.0:
            raise InvalidOptionError(f"c1 must be in (0, 1), got {c1!r}; try 1e-4")
        if not 0.0 < shrink < 1.0:
            raise InvalidOptionError(f"shrink must be in (0, 1), got {shrink!r}; try 0.5")
        if not (math.isfinite(grow) and grow >= 1.0):
            raise InvalidOptionError(f"grow must be a finite number >= 1, got {grow!r}; try 2.0")
        if isinstance(max_evals, bool) or not isinstance(max_evals, int) or max_evals < 1:
            raise InvalidOptionError(f"max_evals must be an int >= 1, got {max_evals!r}; try 40")
        self.step_size = float(step)
        self.c1 = float(c1)
        self.shrink = float(shrink)
        self.grow = float(grow)
        self.max_evals = max_evals
        self.max_step = float(max_step)
        self._phi0 = math.nan
        self._dphi0 = math.nan
        self._stp = self.step_size
        self._n_evals = 0
        self._result: LineSearchResult | None = None
        self._active = False

    def start(self, phi0: float, dphi0: float) -> float:
        """Begin a search from ``phi(0) = phi0`` with slope ``dphi0`` (< 0); return the first trial step.

        If ``dphi0`` is not negative and finite the search ends at once as ``"failed"`` (check
        :attr:`done`).
        """
        self._phi0, self._dphi0 = float(phi0), float(dphi0)
        self._stp = self.step_size
        self._n_evals = 0
        self._result = None
        self._active = True
        if not (math.isfinite(self._phi0) and math.isfinite(self._dphi0) and self._dphi0 < 0.0):
            self._result = LineSearchResult(
                "failed", 0.0, self._phi0, self._dphi0, False, 0,
                f"not a descent direction or not finite: phi(0)={self._phi0!r}, phi'(0)={self._dphi0!r}",
            )  # fmt: skip
        return self._stp

    def tell(self, phi: float, dphi: float | None = None) -> LineSearchResult | None:
        """Feed ``phi(step)`` (``dphi`` is optional and only passed through to the result).

        Returns
        -------
        LineSearchResult or None
            The outcome when the search ended, else ``None`` (evaluate the new :attr:`step`).
        """
        if not self._active or self._result is not None:
            raise ProtocolError("call start() before tell(), and start a new search after one ended")
        self._n_evals += 1
        t, f = self._stp, float(phi)
        if math.isfinite(f) and f <= self._phi0 + self.c1 * t * self._dphi0:
            self.step_size = min(t * self.grow, self.max_step)
            self._result = LineSearchResult(
                "converged", t, f, dphi, True, self._n_evals, "Armijo condition holds"
            )
            return self._result
        if self._n_evals >= self.max_evals:
            self.step_size = t * self.shrink
            self._result = LineSearchResult(
                "failed", 0.0, self._phi0, self._dphi0, False, self._n_evals,
                f"no step satisfying the Armijo condition in {self.max_evals} trials (smallest {t:.3g})",
            )  # fmt: skip
            return self._result
        self._stp = t * self.shrink
        return None
