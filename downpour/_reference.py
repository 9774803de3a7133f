"""Single-process references: plain sequential mini-batch SGD and Adagrad, in numpy.

What one Downpour replica with ``n_fetch = n_push = 1`` must reduce to (paper, section 4.1, "traditional
SGD"), and the baseline row of the Figure 4 benchmark. The updates are the shards' own functions
(:func:`storage.sgd_update`, :func:`storage.adagrad_update`), which act element by element, so applying them
to the whole vector or shard by shard gives the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from distbelief.models import Model
from distbelief.storage import adagrad_update, axpy, check_rule, sgd_update

__all__ = ["ReferenceResult", "sequential_sgd"]


@dataclass
class ReferenceResult:
    """The outcome of :func:`sequential_sgd`.

    Examples
    --------
    >>> from distbelief import models
    >>> res = sequential_sgd(models.LeastSquares(1), np.ones((2, 1)), np.ones(2), np.zeros(2), [[0, 1]])
    >>> res.steps, res.stop_reason
    (1, 'batches')

    Attributes
    ----------
    x : numpy.ndarray
        Final parameters.
    losses : numpy.ndarray
        Mini-batch mean loss (data term, before the step) of every step.
    steps : int
        Steps taken.
    stop_reason : str
        ``"batches"`` (the batches ran out), ``"callback"``, ``"on_snapshot"`` or ``"time_limit"``.
    wall_time : float
        Seconds (snapshots and ``on_snapshot`` not counted).
    checkpoints : list of (float, int, numpy.ndarray)
        With ``snapshot_every``: ``(seconds, steps, w)`` at each snapshot and at the end.
    """

    x: np.ndarray
    losses: np.ndarray
    steps: int
    stop_reason: str
    wall_time: float
    checkpoints: list[tuple[float, int, np.ndarray]] = field(default_factory=list)


def sequential_sgd(
    model: Model,
    X: np.ndarray,
    y: np.ndarray,
    x0: np.ndarray,
    batches: Iterable[np.ndarray],
    *,
    rule: str = "sgd",
    lr: float = 0.1,
    l2: float = 0.0,
    time_limit: float | None = None,
    snapshot_every: float | None = None,
    on_snapshot: Callable[[float, int, np.ndarray], bool] | None = None,
    callback: Callable[[int, np.ndarray], None] | None = None,
) -> ReferenceResult:
    """Mini-batch SGD or Adagrad in one process: ``w -= lr * g`` or the paper's Adagrad, one batch at a time.

    ``g`` is the mini-batch mean gradient of the data term plus ``l2 * w``, exactly what a Downpour replica
    pushes.

    Parameters
    ----------
    model : Model
        Anything with ``loss_and_grad(w, X, y)`` (sum over rows).
    X, y : numpy.ndarray
        The rows that ``batches`` index into.
    x0 : numpy.ndarray
        Starting parameters (copied).
    batches : iterable of integer arrays
        Row indices of each mini-batch, in order (e.g. a ``BatchPlan``'s, as global row indices).
    rule : {"sgd", "adagrad"}
        Update rule.
    lr : float
        Learning rate (Adagrad's gamma).
    l2 : float
        L2 regularization.
    time_limit : float, optional
        Stop after this many seconds.
    snapshot_every : float, optional
        Keep ``(seconds, step, copy of w)`` about this often in ``checkpoints`` (for accuracy-vs-time
        curves); the copies are not counted in the time.
    on_snapshot : callable, optional
        ``on_snapshot(seconds, step, w)`` at every snapshot, not counted in the time either (e.g. a held-out
        evaluation); returning True stops the run (``stop_reason="on_snapshot"``).
    callback : callable, optional
        ``callback(step, w)`` after every step; raising ``StopIteration`` stops.

    Returns
    -------
    ReferenceResult

    Examples
    --------
    >>> from distbelief import models
    >>> X = np.array([[1.0], [2.0]]); y = np.array([1.0, 2.0])
    >>> res = sequential_sgd(models.LeastSquares(1, fit_intercept=False), X, y, np.zeros(1),
    ...                      [np.array([0, 1])] * 50, lr=0.3)
    >>> round(float(res.x[0]), 6)
    1.0
    """
    check_rule(rule)
    w = np.array(x0, dtype=np.float64, copy=True)
    acc = np.zeros_like(w)
    losses: list[float] = []
    checkpoints: list[tuple[float, int, np.ndarray]] = []
    paused = 0.0
    t0 = time.perf_counter()
    next_snapshot = 0.0
    stop_reason = "batches"
    for rows in batches:
        now = time.perf_counter() - t0 - paused
        if snapshot_every is not None and now >= next_snapshot:
            t_pause = time.perf_counter()
            checkpoints.append((now, len(losses), w.copy()))
            next_snapshot = now + snapshot_every
            stop = on_snapshot is not None and on_snapshot(now, len(losses), w)
            paused += time.perf_counter() - t_pause
            if stop:
                stop_reason = "on_snapshot"
                break
        if time_limit is not None and now >= time_limit:
            stop_reason = "time_limit"
            break
        Xb, yb = X[rows], y[rows]
        n = int(Xb.shape[0])
        loss, grad = model.loss_and_grad(w, Xb, yb)
        g = np.multiply(np.asarray(grad, dtype=np.float64), 1.0 / n)
        if l2:
            axpy(l2, w, g)
        losses.append(float(loss) / n)
        if rule == "sgd":
            sgd_update(w, g, lr=lr)
        else:
            adagrad_update(w, g, acc, lr=lr)
        if callback is not None:
            try:
                callback(len(losses), w)
            except StopIteration:
                stop_reason = "callback"
                break
    wall = time.perf_counter() - t0 - paused
    if snapshot_every is not None:
        checkpoints.append((wall, len(losses), w.copy()))
    return ReferenceResult(
        x=w,
        losses=np.array(losses),
        steps=len(losses),
        stop_reason=stop_reason,
        wall_time=wall,
        checkpoints=checkpoints,
    )
