"""Compressed Downpour pushes: Strom's threshold quantization with a residual (no Dask inside).

Strom, "Scalable distributed DNN training using commodity GPU cloud computing" (Interspeech 2015; described
in the data-parallel training overview beside the DistBelief paper, whose section 4.1 this extends): each
replica keeps a *residual* vector ``r``. For every push it adds the accrued gradient to ``r``, sends only the
entries with ``|r_i| >= tau``, each as ``+tau`` or ``-tau`` (index and sign: 4 bytes an entry), and keeps
the rest, ``r - sent``, for later pushes. No gradient is dropped, only delayed: at any moment

    sum of the gradients added == sum of what was sent + r

(exactly, in floating point, whenever the additions are exact; see :meth:`ThresholdCompressor.add`), and
every entry of ``r`` moves towards 0 by ``tau`` each time it is sent. Large and persistent gradient entries
go out at the rate of their size, small ones once they have built up, as Strom describes.

What is sent travels as sign-coded keys per shard (:func:`storage._keys.split_keys` cut at the shards'
bounds, then :func:`storage._keys.encode_signs`): the same key encoding as key-value pushes, with the sign in
place of the value. A shard applies its rule (SGD or Adagrad) to those ``+/-tau`` entries as to any
key-value push.

Examples
--------
>>> comp = ThresholdCompressor(4, Compression(tau=1.0))
>>> idx, neg = comp.add(np.array([0.5, 1.5, -2.5, 0.0]))
>>> idx.tolist(), neg.tolist(), comp.residual.tolist()
([1, 2], [False, True], [0.5, 0.5, -1.5, 0.0])
>>> [c.tolist() for c in encode(idx, neg, (0, 2, 4))]
[[1], [-1]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError
from distbelief.storage.internal import encode_signs, split_keys

__all__ = ["Compression", "ThresholdCompressor", "check_compression", "encode", "signed_bytes"]


@dataclass(frozen=True, kw_only=True)
class Compression:
    """Compressed pushes (Strom 2015): send residual entries with ``|r_i| >= tau`` as ``+/-tau``.

    Parameters
    ----------
    tau : float
        The threshold and the quantum, in the units of the mini-batch mean gradient (the shards apply their
        rule to ``+/-tau``: SGD moves a parameter by ``lr * tau``). A larger ``tau`` sends fewer entries
        per push (more compression) and delays more of the gradient.

    Examples
    --------
    >>> Compression(tau=0.01).tau
    0.01
    >>> Compression(tau=0)
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: Compression(tau=0) is invalid: tau must be a finite number > 0 ...
    """

    tau: float

    def __post_init__(self) -> None:
        tau = self.tau
        ok = isinstance(tau, int | float) and not isinstance(tau, bool) and math.isfinite(tau) and tau > 0
        if not ok:
            raise InvalidOptionError(
                f"Compression(tau={tau!r}) is invalid: tau must be a finite number > 0 (the threshold, in "
                "units of the mini-batch mean gradient; e.g. a few times the typical gradient entry)"
            )
        object.__setattr__(self, "tau", float(tau))


def check_compression(value: Any) -> Compression | None:
    """``value`` if it is None or a :class:`Compression`; otherwise a clear error.

    Examples
    --------
    >>> check_compression(None) is None
    True
    >>> check_compression(0.1)
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: option compression=0.1 is invalid: expected None (uncompressed ...
    """
    if value is None or isinstance(value, Compression):
        return value
    raise InvalidOptionError(
        f"option compression={value!r} is invalid: expected None (uncompressed pushes) or "
        "downpour.Compression(tau=...) (Strom's threshold compression)"
    )


class ThresholdCompressor:
    """One replica's residual and the threshold step of :class:`Compression` (see the module docstring).

    Parameters
    ----------
    n : int
        Parameters in the pushed vector.
    options : Compression
        The threshold.
    """

    def __init__(self, n: int, options: Compression) -> None:
        self.tau = options.tau
        self.residual = np.zeros(n)

    def add(self, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add ``grad`` to the residual and take out what is sent: ``(indices, negative)``.

        ``indices`` (int64, sorted) are the entries with ``|r_i| >= tau`` after the addition; each sends
        ``-tau`` where ``negative`` else ``+tau`` and its residual entry moves by that much towards 0.
        The subtraction is exact whenever ``|r_i| <= 2 tau`` (Sterbenz), so ``sent + r`` equals the sum of
        the gradients added up to the rounding of the additions themselves.
        """
        grad = np.asarray(grad, dtype=np.float64)
        if grad.shape != self.residual.shape:
            raise InvalidOptionError(
                f"compression: a gradient of shape {grad.shape} for a residual of {self.residual.shape}"
            )
        r = self.residual
        r += grad
        idx = np.flatnonzero(np.abs(r) >= self.tau)
        negative = r[idx] < 0
        r[idx] -= np.where(negative, -self.tau, self.tau)
        return idx, negative


def encode(idx: np.ndarray, negative: np.ndarray, bounds: Sequence[int]) -> list[np.ndarray]:
    """Per shard, the sign-coded local keys of the sent entries (``storage._keys`` encoding)."""
    keys = split_keys(bounds, np.asarray(idx, dtype=np.int64))
    cuts = np.searchsorted(idx, np.asarray(bounds, dtype=np.int64))
    return [encode_signs(k, negative[cuts[i] : cuts[i + 1]]) for i, k in enumerate(keys)]


def signed_bytes(codes: Sequence[np.ndarray]) -> int:
    """Bytes of a compressed push on the wire: the sign-coded keys and one float64 ``tau`` per shard.

    Examples
    --------
    >>> signed_bytes([np.zeros(3, np.int32), np.zeros(0, np.int32)])
    28
    """
    return sum(int(c.nbytes) + 8 for c in codes)
