"""What the Downpour driver watches in its history: divergence (stop the run) and a stalled step rule (warn).

Plain python and numpy, no Dask: :func:`downpour.train` feeds every history row to a :class:`Watchdog` and
asks it, at the end, whether the run stalled.

* **Divergence.** A run diverges when its training objective (``F`` on the training rows at the row's
  parameters), its training loss (the mean mini-batch loss since the previous row) or its held-out loss
  becomes NaN or infinite, or when the objective or the held-out loss grows past its bound:
  ``max_loss_growth`` times the lowest value it had so far (that lowest value counted as at least a tenth of
  its first one; no bound for a loss whose first value is not positive), and never below its first value
  (their value at the starting point), with a relative slack of :data:`BOUND_RTOL` for rounding, on
  :data:`SPIKE_ROWS` rows in a row: one row past the bound that the next row takes back is a spike, which
  asynchronous SGD with stale gradients has (issue 27: 1 of 15 identical runs was stopped as diverged and
  ended at training accuracy 1.0), not divergence. So a loss that climbs back above where it started after
  falling tenfold and stays there has diverged, noise on a tiny loss has not, and neither has a loss back
  at exactly its starting value (a replica whose first fetch came before
  any push was applied takes its first step at the starting point). (4 replicas with a fixed rate on the
  digits MLP: held-out loss 0.39, then 5.4 at chance accuracy.) The running training loss is judged for
  growth only in a run whose rows carry no parameters (no objective): a short run records a row every step
  or two, so a row's running loss is one mini-batch or two, and one 16-row batch of breast-cancer
  logistic regression scored 0.74 where ``F`` was 0.23, past a bound of ln 2 (the first row) once another
  batch had scored 0.005. The run stops with ``success=False``, ``stop_reason="diverged"`` and a message
  that names the loss, its values and what to do (lower ``lr``, ``rule="adagrad"``,
  ``staleness_scale=True`` or fewer replicas).
* **Stall.** A step rule stalls when the objective is flat while the gradient is not small: over the last
  :data:`STALL_WINDOW` of the run (by steps) the training loss (or, with held-out rows, the held-out loss)
  fell by less than :data:`STALL_FLAT` of its value, yet the full gradient of ``F`` at the final parameters
  is still more than :data:`STALL_GRAD` of its norm at the start, judged on at least
  :data:`STALL_MIN_ROWS` history rows within that window (fewer measure no trend: a short run is not
  judged). Adagrad whose accumulators have grown
  large, or a fixed rate scaled down by staleness, looks like that. The driver then adds a warning to the
  result's message and ``history.attrs["warnings"]`` and issues a :class:`StepRuleStallWarning`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "BOUND_RTOL",
    "SPIKE_ROWS",
    "STALL_FLAT",
    "STALL_GRAD",
    "STALL_MIN_ROWS",
    "STALL_WINDOW",
    "StepRuleStallWarning",
    "Watchdog",
    "stall_message",
]

#: Relative slack on the divergence bound. A history row's training loss is a difference of cumulative float
#: sums (``downpour._train``): a window of steps all at the starting point came out one ulp above the first
#: row's value, which after a tenfold fall is the bound itself, and the run stopped as diverged at ln 2.
#: Real divergence overshoots by orders of magnitude; that rounding is ~1e-16 times the ratio of the
#: cumulative sum to the window's (1e-10 at a ratio of a million).
BOUND_RTOL = 1e-6
#: Rows in a row past the bound that make divergence (NaN / inf: one row).
SPIKE_ROWS = 2
#: The last fraction of the run (by steps) over which a stall is judged.
STALL_WINDOW = 1 / 3
#: History rows with a finite loss that the window must hold for a verdict. With two, a short run's last row
#: and the one before it (often the same parameters seen twice, at the run's end) read as "flat": tests of
#: a few dozen steps were warned of a stall they could not have.
STALL_MIN_ROWS = 3
#: The loss counts as flat when it fell by less than this fraction over the window.
STALL_FLAT = 0.01
#: The gradient counts as not small while its norm is above this fraction of the starting one. Mini-batch
#: Adagrad at its noise floor leaves it at 2.5-7.5% (the demo's Downpour job on the digits, 24 runs of 600 and
#: 1000 epochs, objective within 1-4% of the optimum: at 5% the warning fired in 2 of them); the stalled
#: rule of tests/downpour/test_robustness.py is still warned at this bound.
STALL_GRAD = 0.1


class StepRuleStallWarning(UserWarning):
    """Downpour's step rule stalled: the objective is flat while the gradient is not small."""


@dataclass
class Watchdog:
    """Watches a run's history rows for divergence.

    Parameters
    ----------
    max_loss_growth : float or None
        A loss above this multiple of its lowest value so far is divergence (see the module docstring;
        None: only NaN / inf are).
    running_loss_growth : bool
        Judge the running mini-batch loss for growth as well as for NaN / inf.

    Examples
    --------
    >>> w = Watchdog(10.0)
    >>> w.observe(train_loss=float("nan"), test_loss=2.3)   # no rows yet: NaN is "nothing measured"
    >>> w.observe(train_loss=2.0, test_loss=2.2)
    >>> w.observe(train_loss=0.3, test_loss=0.4)
    >>> w.observe(train_loss=3.5, test_loss=0.5) is not None     # a spike: one row past the bound
    False
    >>> w.observe(train_loss=3.6, test_loss=0.5) is not None     # and the next one too
    True
    """

    max_loss_growth: float | None = 10.0
    #: Whether the running mini-batch loss is judged for growth too (else only for NaN / inf): the driver
    #: turns it off when its rows carry the training objective.
    running_loss_growth: bool = True
    first: dict[str, float] = field(default_factory=dict)
    best: dict[str, float] = field(default_factory=dict)
    #: Per loss, the consecutive rows so far past its bound.
    over: dict[str, int] = field(default_factory=dict)
    message: str | None = None

    def observe(
        self,
        *,
        train_loss: float,
        test_loss: float,
        x_finite: bool = True,
        objective: float = math.nan,
        evaluated: bool = True,
    ) -> str | None:
        """One history row; returns the divergence message once the run has diverged, else None.

        ``train_loss`` is NaN when no step was taken since the previous row, ``test_loss`` NaN without
        held-out rows, and ``objective`` (the training objective at the row's parameters) NaN on a row
        recorded without them: NaN there means "not measured", except for a held-out loss once one was
        measured on a row that was ``evaluated`` (a row whose parameters were not read, e.g. one a windowed
        sparse run left to the shards' parameters when reading them was not affordable, measured nothing),
        or with ``x_finite`` False (the parameters themselves hold NaN or inf).

        Examples
        --------
        >>> w = Watchdog(10.0)
        >>> w.observe(train_loss=0.7, test_loss=0.7), w.observe(train_loss=0.6, test_loss=math.nan,
        ...                                                     evaluated=False)
        (None, None)
        >>> w.observe(train_loss=0.6, test_loss=math.nan)
        "diverged: the held-out loss became nan; lower lr, ..."
        """
        if self.message is not None:
            return self.message
        if not x_finite:
            self.message = "the parameters became NaN or infinite"
        named = (
            ("training objective", objective),
            ("training loss", train_loss),
            ("held-out loss", test_loss),
        )
        for name, value in named:
            if self.message is not None:
                break
            if math.isnan(value) and not (name == "held-out loss" and name in self.first and evaluated):
                continue
            if not math.isfinite(value):
                self.message = f"the {name} became {value}"
            elif name == "training loss" and not self.running_loss_growth:
                continue  # a window of one mini-batch or two: only NaN / inf say something
            elif name not in self.first:
                self.first[name] = self.best[name] = value
            elif self.max_loss_growth is not None and value > self.bound(name) * (1.0 + BOUND_RTOL):
                self.over[name] = self.over.get(name, 0) + 1
                if self.over[name] >= SPIKE_ROWS:
                    self.message = (
                        f"the {name} grew from {self.best[name]:.4g} (its lowest) to {value:.4g}, past "
                        f"max_loss_growth={self.max_loss_growth:g} times that "
                        f"({self.over[name]} history rows in a row)"
                    )
            else:
                self.over[name] = 0
                self.best[name] = min(self.best[name], value)
        if self.message is None:
            return None
        self.message = (
            f"diverged: {self.message}; lower lr, or use rule='adagrad', staleness_scale=True, "
            "max_staleness= or fewer replicas"
        )
        return self.message

    def bound(self, name: str) -> float:
        """The value past which loss ``name`` counts as diverged (see the module docstring)."""
        assert self.max_loss_growth is not None
        first = self.first[name]
        if first <= 0:
            # A multiple of a loss that starts at or below zero (a user's model, ConstantGradient in the
            # tests) bounds nothing: only NaN / inf count. Noise between two fine-grained rows tripped it.
            return math.inf
        return max(first, self.max_loss_growth * max(self.best[name], 0.1 * first))


def stall_message(
    steps: Sequence[float],
    losses: Sequence[float],
    grad_norm_start: float,
    grad_norm_end: float,
    *,
    what: str = "training loss",
) -> str | None:
    """The stall warning of a finished run, or None when it did not stall (see the module docstring).

    ``steps`` is the run's step count at each history row: the last third is by steps, not by time (a run's
    final row comes after its replicas have stopped and flushed, a gap in time that left a short run's last
    third of time holding that row alone).

    Examples
    --------
    >>> t, loss = [0, 10, 20, 30, 40, 50, 60], [1.0, 0.8, 0.7, 0.65, 0.6499, 0.6498, 0.6497]
    >>> stall_message(t, loss, 1.0, 0.5) is not None  # flat from step 40, the gradient still half its size
    True
    >>> stall_message(t, loss, 1.0, 0.001) is None  # converged
    True
    >>> stall_message(t[:4], loss[:4], 1.0, 0.5) is None  # one row in the last third: not judged
    True
    """
    t = np.asarray(steps, dtype=float)
    v = np.asarray(losses, dtype=float)
    keep = np.isfinite(v)
    t, v = t[keep], v[keep]
    if t.size < 3 or not (math.isfinite(grad_norm_start) and math.isfinite(grad_norm_end)):
        return None
    start = t[-1] - STALL_WINDOW * (t[-1] - t[0])
    window = v[t >= start]
    if window.size < STALL_MIN_ROWS:
        return None
    drop = (window[0] - window[-1]) / max(abs(window[0]), 1e-12)
    grad_ratio = grad_norm_end / max(grad_norm_start, 1e-300)
    if drop >= STALL_FLAT or grad_ratio <= STALL_GRAD:
        return None
    return (
        f"the step rule stalled: the {what} fell by only {100 * max(drop, 0.0):.2g}% over the last third of "
        f"the run while the gradient norm is still {grad_ratio:.2g} of its starting value; raise lr "
        "(Adagrad's step shrinks as its accumulators grow), use staleness_scale=False, or train longer"
    )
