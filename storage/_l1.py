"""The L1 kernels of OWL-QN on one slice of the parameters (Andrew & Gao, ICML 2007).

Plain numpy functions with no Dask or zarr inside, like :mod:`storage._rules`: a shard runs them on its slice
(the ``pseudo_grad``, ``sign_align``, ``orthant``, ``project_orthant``, ``nnz`` and ``norm1`` ops of
:class:`storage._shard.Shard`) and :class:`sandblaster._space.InProcessSpace` on the whole vector, so both
spaces compute the same bits. Every one of them is elementwise, so a slice's result is the slice of the
whole vector's result (``nnz`` and ``norm1`` return a partial the caller sums over shards).

With ``F(x) = f(x) + l1 ||x||_1`` (``f`` smooth, gradient ``g``), OWL-QN needs:

* the pseudo-gradient ``v`` (the minimum-norm element of the subdifferential, section 3.1 of the paper);
* the direction ``d`` projected onto the signs of ``-v`` (``p = pi(d; -v)``);
* the orthant ``xi = sign(x)``, or ``sign(-v)`` where ``x = 0``;
* the trial point projected onto that orthant (``pi(x + t p; xi)``).

Vectors of at least :data:`storage._kernels.COMPILED_FROM` elements go through compiled loops, one pass
each and no temporaries (OWL-QN's extra ops were the larger part of its cost at 2^24 parameters); their
results are those of the numpy expressions here, element by element (exact operations, and ``g + l1 *
sign(x)`` rounded once in both).

Parameters the L1 term leaves out (intercepts, as scikit-learn's) are given as ``free``: ranges
``(start, stop)`` of the slice's own offsets. There the pseudo-gradient is the gradient, the projection
leaves the coordinate alone and ``norm1`` does not count it: OWL-QN with a per-coordinate weight that is
0 there (Andrew & Gao, section 3.2, note that the regularizer may weight coordinates differently).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from . import _kernels

Ranges = Sequence[tuple[int, int]]

__all__ = [
    "local_ranges",
    "nnz",
    "norm1",
    "orthant",
    "project_orthant",
    "pseudo_gradient",
    "sign_align",
]


def _pseudo_gradient_loop(
    out: np.ndarray, g: np.ndarray, x: np.ndarray, l1: float
) -> None:  # pragma: no cover
    for i in range(out.size):
        xi, gi = x[i], g[i]
        if xi != 0.0:
            out[i] = gi + l1 * (1.0 if xi > 0.0 else (-1.0 if xi < 0.0 else xi))  # xi NaN: NaN
        else:
            out[i] = gi - min(max(gi, -l1), l1)


def _sign_align_loop(d: np.ndarray, v: np.ndarray) -> None:  # pragma: no cover
    for i in range(d.size):
        vi = v[i]
        if d[i] * (1.0 if vi > 0.0 else (-1.0 if vi < 0.0 else vi)) >= 0.0:
            d[i] = 0.0


def _orthant_loop(out: np.ndarray, x: np.ndarray, v: np.ndarray) -> None:  # pragma: no cover
    for i in range(out.size):
        t = x[i] if x[i] != 0.0 else -v[i]
        out[i] = 1.0 if t > 0.0 else (-1.0 if t < 0.0 else t + 0.0)


def _project_orthant_loop(x: np.ndarray, xi: np.ndarray, lo: int, hi: int) -> None:  # pragma: no cover
    for i in range(lo, hi):
        xv = x[i]
        if (1.0 if xv > 0.0 else (-1.0 if xv < 0.0 else xv)) != xi[i]:
            x[i] = 0.0


def _loop(fn: object, n: int) -> object | None:
    """The compiled ``fn`` for vectors of ``n`` elements (None: use the numpy expression)."""
    return _kernels.compiled(fn) if n >= _kernels.COMPILED_FROM else None  # type: ignore[arg-type]


def pseudo_gradient(
    g: np.ndarray, x: np.ndarray, l1: float, free: Ranges = (), *, out: np.ndarray | None = None
) -> np.ndarray:
    """The pseudo-gradient of ``f(x) + l1 ||x||_1`` from the gradient ``g`` of ``f`` (into ``out``, or a
    new array).

    ``g_i + l1 sign(x_i)`` where ``x_i != 0``; where ``x_i = 0``, ``g_i + l1`` if that is negative,
    ``g_i - l1`` if that is positive, else 0 (``g_i - clip(g_i, -l1, l1)``). With ``l1 = 0`` it is ``g``,
    and so it is in the ``free`` ranges.

    Examples
    --------
    >>> pseudo_gradient(np.array([0.5, 0.5, 2.0, -2.0]), np.array([1.0, 0.0, 0.0, 0.0]), 1.0)
    array([ 1.5,  0. ,  1. , -1. ])
    >>> pseudo_gradient(np.array([0.5, 0.5]), np.array([1.0, 0.0]), 1.0, free=[(1, 2)])
    array([1.5, 0.5])
    """
    if out is None:
        out = np.empty_like(g)
    loop = _loop(_pseudo_gradient_loop, g.size)
    if loop is not None:
        loop(np.asarray(out), np.asarray(g), np.asarray(x), float(l1))  # type: ignore[operator]
    else:
        moved = x != 0.0
        plain = np.subtract(g, np.clip(g, -l1, l1))
        plain[moved] = g[moved] + l1 * np.sign(x[moved])
        out[:] = plain
    for a, b in free:
        out[a:b] = g[a:b]
    return out


def sign_align(d: np.ndarray, v: np.ndarray) -> None:
    """Zero, in place, every ``d_i`` whose sign is not that of ``-v_i`` (``d_i v_i >= 0``).

    Examples
    --------
    >>> d = np.array([-1.0, 1.0, 1.0, 2.0]); sign_align(d, np.array([1.0, 1.0, 0.0, -1.0])); d
    array([-1.,  0.,  0.,  2.])
    >>> d = np.array([1e-200]); sign_align(d, np.array([-1e-200])); d  # d * v underflows to 0: kept
    array([1.e-200])
    """
    # Times sign(v), not v: d * v underflows to 0 for tiny entries, and a descent coordinate was dropped.
    loop = _loop(_sign_align_loop, d.size)
    if loop is not None:
        loop(np.asarray(d), np.asarray(v))  # type: ignore[operator]
    else:
        d[d * np.sign(v) >= 0.0] = 0.0


def orthant(x: np.ndarray, v: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """The orthant OWL-QN's step stays in: ``sign(x_i)``, or ``sign(-v_i)`` where ``x_i = 0`` (into ``out``,
    or a new array).

    Examples
    --------
    >>> orthant(np.array([2.0, 0.0, 0.0, -1.0]), np.array([1.0, 1.0, 0.0, 3.0]))
    array([ 1., -1.,  0., -1.])
    """
    if out is None:
        out = np.empty_like(x)
    loop = _loop(_orthant_loop, x.size)
    if loop is not None:
        loop(np.asarray(out), np.asarray(x), np.asarray(v))  # type: ignore[operator]
    else:
        out[:] = np.sign(np.where(x != 0.0, x, -v)) + 0.0  # + 0.0: no -0.0 entries
    return out


def project_orthant(x: np.ndarray, xi: np.ndarray, free: Ranges = ()) -> None:
    """Zero, in place, every ``x_i`` whose sign is not ``xi_i`` (the coordinates that left the orthant),
    except in the ``free`` ranges (no L1 term there: no orthant to stay in).

    Examples
    --------
    >>> x = np.array([0.5, -0.5, 0.0, 3.0]); project_orthant(x, np.array([1.0, 1.0, -1.0, 0.0])); x
    array([0.5, 0. , 0. , 0. ])
    >>> x = np.array([-0.5, -0.5]); project_orthant(x, np.array([1.0, 1.0]), free=[(1, 2)]); x
    array([ 0. , -0.5])
    """
    loop = _loop(_project_orthant_loop, x.size)
    if loop is None:
        left = np.sign(x) != xi
        for a, b in free:
            left[a:b] = False
        x[left] = 0.0
        return
    start = 0  # the loop over the parts outside the free ranges
    for a, b in sorted((int(a), int(b)) for a, b in free):
        loop(np.asarray(x), np.asarray(xi), start, max(start, a))  # type: ignore[operator]
        start = max(start, b)
    loop(np.asarray(x), np.asarray(xi), start, x.size)  # type: ignore[operator]


def nnz(x: np.ndarray) -> int:
    """Number of nonzero entries.

    Examples
    --------
    >>> nnz(np.array([0.0, -0.0, 1e-300, 2.0]))
    2
    """
    return int(np.count_nonzero(x))


def norm1(x: np.ndarray, free: Ranges = ()) -> float:
    """``||x||_1`` outside the ``free`` ranges, summed as ``numpy.sum`` does (pairwise).

    Examples
    --------
    >>> norm1(np.array([1.0, -2.0, 0.5]))
    3.5
    >>> norm1(np.array([1.0, -2.0, 0.5]), free=[(1, 2)])
    1.5
    """
    if x.size >= _kernels.COMPILED_FROM:
        # Blocks of numpy's pairwise sum of |x|, added in block order: no temporary of the vector's size.
        total = 0.0
        cuts = sorted({0, x.size, *(min(max(int(c), 0), x.size) for r in free for c in r)})
        for a, b in itertools.pairwise(cuts):
            if any(lo <= a and b <= hi for lo, hi in free):
                continue
            for start in range(a, b, _kernels.DOT_BLOCK):
                total += float(np.abs(x[start : min(b, start + _kernels.DOT_BLOCK)]).sum())
        return total
    a = np.abs(x)  # a new array: zeroing the free ranges leaves x alone
    if free:
        for lo, hi in free:
            a[lo:hi] = 0.0
    return float(a.sum())


def local_ranges(free: Ranges, lo: int, hi: int) -> list[tuple[int, int]]:
    """Global ranges ``free`` as offsets into the slice ``[lo, hi)`` (the parts inside it).

    Examples
    --------
    >>> local_ranges([(3, 6), (9, 10)], 5, 9)
    [(0, 1)]
    """
    out = []
    for a, b in free:
        a, b = max(int(a), lo), min(int(b), hi)
        if a < b:
            out.append((a - lo, b - lo))
    return out
