"""Reproducible summation of vectors: the same bits whatever the order and grouping of the terms.

Float addition is not associative, so a shard that adds gradient pushes in arrival order gives sums that
change with replica timing (issue 18, item 6). This module sums *binned*, in the spirit of ReproBLAS
(Demmel & Nguyen, "Parallel Reproducible Summation", IEEE TC 2015; Ahrens, Demmel & Nguyen, "Algorithms
for Efficient Reproducible Floating Point Summation", ACM TOMS 2020), in a simpler form:

* every element's value line is cut into *bins* of ``W`` bits on a global lattice: bin ``j`` holds
  multiples of ``2**(j*W)`` below ``2**((j+1)*W)``. A term ``v`` is split by truncation,
  ``q_j = trunc(r_j / 2**(j*W)) * 2**(j*W)`` with ``r_j`` what the higher bins left, so ``q_j(v)``
  depends on ``v`` and ``j`` alone;
* a *state* keeps, per element, the top bin ``b`` (that of the largest term seen: a max, so it does not
  depend on order) and the exact sums of the ``K`` bins ``b, b-1, ..., b-K+1``. Each bin sum is an integer
  multiple of its unit below ``2**(W + HEADROOM_BITS)``, exact in a float64, so adding bins is exact, and
  merging two states (raise the lower one's top bin, dropping what falls below the kept bins) gives the
  same state as depositing every term into one state;
* :func:`value` rounds a state to float64 (top bin first, a fixed order): the result is a function of the
  multiset of terms only. Bits of a term below ``2**((b-K+1)*W)`` are dropped, ``2**-(K-1)*W = 2**-64``
  relative to the largest term at worst: finer than float64's own rounding of a plain sum.

Non-finite terms (and finite ones of magnitude ``>= 2**LIMIT_EXP``, which would overflow a bin: they
become infinities) go to a top "special" bin where they are added as floats; sums of infinities and NaNs
do not depend on order.

A state is one float64 array of shape ``(K + 1, n)``: row 0 the top bin's unit ``2**(b*W)`` (0 while
empty, ``inf`` once special: a max of units is a max of bins), rows ``1..K`` the bin sums from the top
down. It slices along its last axis like the vector it sums (one shard's range), and travels as one array.
Memory: ``(K + 1) * 8 = 32`` bytes per element instead of 8. Time: a deposit is ~20 passes over the
vector (``benchmarks/reproducible_cost.py --micro``), a merge of two states with the same top bins 3.

Examples
--------
>>> import numpy as np
>>> terms = [np.array([1.0, 1e-17]), np.array([1e16, -3.0]), np.array([-1e16, 3.0])]
>>> a = zeros(2)
>>> for t in terms:  # one at a time, in order
...     _ = deposit(a, t)
>>> b = deposit(zeros(2), terms[2])  # another order and grouping: the last term, then a sum of the others
>>> merge(b, deposit(deposit(zeros(2), terms[1]), terms[0]))
>>> bool((value(a) == value(b)).all()), value(a).tolist()  # 1e-17 kept to 2**-64 of the largest term, 3
(True, [1.0, 9.974659986866641e-18])
>>> (1e-17 + -3.0) + 3.0, (-3.0 + 3.0) + 1e-17  # plain float sums in two orders
(0.0, 1e-17)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _kernels

__all__ = [
    "BINS",
    "COMPILED_FROM",
    "HEADROOM_BITS",
    "MAX_TERMS",
    "WIDTH",
    "clear",
    "deposit",
    "deposit_at",
    "merge",
    "value",
    "zeros",
]

#: Bits per bin.
WIDTH = 32
#: Bins kept per element: ``(BINS - 1) * WIDTH = 64`` bits below the top bin at least.
BINS = 3
#: Spare bits in each bin sum: up to ``2**HEADROOM_BITS`` terms are added exactly (``WIDTH + 20 = 52``).
HEADROOM_BITS = 20
#: The most terms one sum may take (a Sandblaster evaluation's terms are its portions).
MAX_TERMS = 1 << HEADROOM_BITS
#: Terms at or above ``2**LIMIT_EXP`` in magnitude count as infinite (a bin sum must stay below 2**1023).
LIMIT_EXP = 960
#: Lowest top bin: the lowest kept bin's unit ``2**((BIN_MIN - BINS + 1) * WIDTH) = 2**-992`` and its inverse
#: stay normal floats; smaller terms keep their bits down to that unit.
BIN_MIN = -29

#: Terms from which :func:`deposit` and :func:`merge` use their compiled loops (one pass per element instead
#: of ~20 numpy passes over the vector); :func:`deposit_at` always does when numba is there. The state they
#: leave is the same: a state is a function of the multiset of terms.
COMPILED_FROM = 1 << 12

_SHIFT = WIDTH.bit_length() - 1  # floor division by WIDTH (a power of two) as an arithmetic shift
assert 1 << _SHIFT == WIDTH
_STEP = 2.0**WIDTH


def zeros(n: int) -> np.ndarray:
    """An empty state for ``n`` elements (every sum 0).

    Examples
    --------
    >>> zeros(3).shape
    (4, 3)
    """
    return np.zeros((BINS + 1, n))


def clear(state: np.ndarray) -> np.ndarray:
    """Empty ``state`` in place (as :func:`zeros`); returns it.

    Examples
    --------
    >>> value(clear(deposit(zeros(1), np.array([5.0])))).tolist()
    [0.0]
    """
    state.fill(0.0)
    return state


def _units(v: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Each term's top-bin unit ``2**(b*W)`` with ``|v| < 2**((b+1)*W)``, ``b >= BIN_MIN`` (zeros and
    subnormals: the lowest), and the mask of special terms (``inf`` unit), or None if there are none.

    Read off the exponent bits: a few integer passes, where ``np.frexp`` and ``np.ldexp`` cost several
    times more (measured with ``benchmarks/reproducible_cost.py --micro``).
    """
    e = (v.view(np.int64) >> 52) & 0x7FF  # biased exponent: 2**(e-1023) <= |v| < 2**(e-1022)
    e -= 1023
    special = e >= LIMIT_EXP
    e >>= _SHIFT
    np.maximum(e, BIN_MIN, out=e)
    e <<= _SHIFT
    e += 1023
    e <<= 52
    units = e.view(np.float64)
    if special.any():
        units[special] = np.inf
        return units, special
    return units, None


def _raise(state: np.ndarray, top: np.ndarray) -> None:
    """Raise ``state``'s top units to ``top`` (each >= its own) in place: bin sums move down, the lowest
    drop. Only the elements whose top changes are touched (after the first terms, few or none)."""
    idx = np.flatnonzero(state[0] != top)
    if not idx.size:
        return
    new = top[idx]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = new / state[0, idx]  # 2**(W*d) for a shift by d bins; inf from empty or to special
    folds = state[1:, idx]
    moved = np.zeros_like(folds)
    for d in range(1, BINS):
        hit = ratio == _STEP**d
        if hit.any():
            moved[d:, hit] = folds[: BINS - d, hit]
    state[1:, idx] = moved
    state[0, idx] = new


def deposit(state: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Add the terms ``v`` (one per element) to ``state`` exactly, in place; returns ``state``.

    Examples
    --------
    >>> s = deposit(zeros(1), np.array([0.1])); value(deposit(s, np.array([0.2]))).tolist()
    [0.30000000000000004]
    """
    v = np.ascontiguousarray(v, dtype=np.float64)
    if v.shape != state.shape[1:]:
        raise ValueError(f"cannot deposit terms of shape {v.shape} into a state for {state.shape[1:]}")
    loop = _loop(_deposit_loop) if v.size >= COMPILED_FROM else None
    if loop is not None:
        loop(state, _ALL, v, v.view(np.int64))
        return state
    return _deposit_numpy(state, v)


def deposit_at(state: np.ndarray, positions: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Add the terms ``v`` to the elements ``positions`` of ``state`` (unique), exactly, in place.

    The state is the one :func:`deposit` of the vector holding ``v`` at ``positions`` and zeros elsewhere
    leaves (a zero term changes nothing), in time proportional to ``v.size``.

    Examples
    --------
    >>> value(deposit_at(zeros(4), np.array([1, 3]), np.array([0.5, -2.0]))).tolist()
    [0.0, 0.5, 0.0, -2.0]
    """
    v = np.ascontiguousarray(v, dtype=np.float64)
    positions = np.asarray(positions)
    if v.ndim != 1 or positions.shape != v.shape:
        raise ValueError(f"deposit_at needs as many positions as terms, got {positions.shape} and {v.shape}")
    _check_positions(positions, state.shape[1])
    loop = _loop(_deposit_loop)
    if loop is not None:
        loop(state, positions.astype(np.int64, copy=False), v, v.view(np.int64))
        return state
    target = state[:, positions]
    _deposit_numpy(target, v)
    state[:, positions] = target
    return state


def _check_positions(positions: np.ndarray, n: int) -> None:
    if positions.size and (positions.dtype.kind not in "iu" or positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must be integers in [0, {n})")


def _deposit_numpy(state: np.ndarray, v: np.ndarray) -> np.ndarray:
    """:func:`deposit` in numpy passes over the vector (the reference of the compiled loop)."""
    units, special = _units(v)
    top = np.maximum(state[0], units)
    _raise(state, top)
    r = v.copy()
    if special is not None or np.isinf(top).any():
        held = np.isinf(top)  # elements holding a non-finite sum keep no finite bins
        if special is not None:
            # Overflowing finite terms count as infinities of their sign; specials sum order-independently
            # (inf + -inf is NaN, whichever comes first).
            add = np.where(np.isnan(v), v, np.copysign(np.inf, v))
            with np.errstate(invalid="ignore"):
                state[1, special] += add[special]
        r[held] = 0.0
        top = np.where(held, 1.0, top)  # a unit that scales 0 to 0
    unit = top.copy()
    inv = 1.0 / top  # exact: powers of two, 2**-928 .. 2**928
    q = np.empty_like(r)
    for k in range(BINS):
        if k:
            unit *= 1.0 / _STEP
            inv *= _STEP
        np.multiply(r, inv, out=q)  # exact: a power-of-two scaling, no under- or overflow
        np.trunc(q, out=q)
        q *= unit
        state[k + 1] += q  # exact: an integer multiple of unit below 2**(WIDTH + HEADROOM_BITS) units
        if k < BINS - 1:
            r -= q  # exact: the bits of r below unit
    return state


def merge(state: np.ndarray, other: np.ndarray) -> None:
    """Add the state ``other`` into ``state`` exactly, in place (``other`` is left as it was).

    Examples
    --------
    >>> a, b = deposit(zeros(1), np.array([1e-20])), deposit(zeros(1), np.array([1.0]))
    >>> merge(a, b); value(a).tolist()
    [1.0]
    """
    if other.shape != state.shape:
        raise ValueError(f"cannot merge a state of shape {other.shape} into one of shape {state.shape}")
    loop = _loop(_merge_loop) if state.shape[1] >= COMPILED_FROM else None
    if loop is not None:
        loop(state, other)
        return
    _merge_numpy(state, other)


def _merge_numpy(state: np.ndarray, other: np.ndarray) -> None:
    """:func:`merge` in numpy passes (the reference of the compiled loop)."""
    top = np.maximum(state[0], other[0])
    _raise(state, top)
    if (other[0] != top).any():
        other = other.copy()
        _raise(other, top)
    with np.errstate(invalid="ignore"):  # inf + -inf in a special bin is NaN, in either order
        state[1:] += other[1:]


#: ``positions`` of the compiled deposit loop meaning "every element, in order".
_ALL = np.zeros(0, dtype=np.int64)
#: The top-bin units ``2**(b*W)`` for ``b = BIN_MIN ..`` the highest finite bin, by ``b - BIN_MIN`` (a
#: table lookup in the compiled loop instead of a libm ``ldexp`` call per term).
_UNIT_TABLE = np.ldexp(1.0, np.arange(BIN_MIN, ((LIMIT_EXP - 1) >> _SHIFT) + 1) * WIDTH)


def _raise_column_py(state: np.ndarray, j: int, top: float) -> None:  # pragma: no cover - compiled
    """:func:`_raise` of column ``j`` of ``state`` to the top unit ``top`` (>= its own): its bin sums move
    down by as many bins as the unit rose, the lowest drop (all of them from an empty column or to a
    special one)."""
    old = state[0, j]
    if old == top:
        return
    d = BINS
    if old != 0.0 and not math.isinf(top):
        ratio = top / old
        step = 1.0
        for k in range(1, BINS):
            step *= _STEP
            if ratio == step:
                d = k
                break
    for k in range(BINS, 0, -1):
        state[k, j] = state[k - d, j] if k - d >= 1 else 0.0
    state[0, j] = top


#: What the compiled loops call to raise a column: :func:`_raise_column_py`, replaced by its compiled
#: dispatcher before the loops are compiled (:func:`_loop`; numba resolves a loop's globals then).
_raise_column = _raise_column_py


def _loop(fn: Any) -> Any | None:
    """The compiled ``fn`` (``_deposit_loop`` or ``_merge_loop``), or None without numba."""
    global _raise_column
    helper = _kernels.compiled(_raise_column_py)
    if helper is None:
        return None
    _raise_column = helper
    return _kernels.compiled(fn)


def _deposit_loop(
    state: np.ndarray, positions: np.ndarray, v: np.ndarray, bits: np.ndarray
) -> None:  # pragma: no cover - compiled
    """:func:`_deposit_numpy`, element by element: the term ``v[i]`` into column ``positions[i]`` (``i``
    if ``positions`` is empty). Every step is the numpy code's on one element, so the states are equal."""
    dense = positions.size == 0
    for i in range(v.size):
        j = i if dense else positions[i]
        x = v[i]
        # The term's top-bin unit, from its exponent bits (_units).
        e = ((bits[i] >> 52) & 0x7FF) - 1023
        special = e >= LIMIT_EXP
        if special:
            unit = math.inf
        else:
            e >>= _SHIFT
            if e < BIN_MIN:
                e = BIN_MIN
            unit = _UNIT_TABLE[e - BIN_MIN]
        top = max(state[0, j], unit)
        _raise_column(state, j, top)
        r = x
        if special:
            state[1, j] += x if math.isnan(x) else math.copysign(math.inf, x)
        if math.isinf(top):
            r = 0.0
            top = 1.0
        unit_k = top
        inv = 1.0 / top
        for k in range(BINS):
            if k:
                unit_k *= 1.0 / _STEP
                inv *= _STEP
            q = np.trunc(r * inv) * unit_k
            state[k + 1, j] += q
            if k < BINS - 1:
                r -= q


def _merge_loop(state: np.ndarray, other: np.ndarray) -> None:  # pragma: no cover
    """:func:`_merge_numpy`, element by element: column ``j`` of ``other`` into column ``j``, both raised
    to their common top unit first."""
    o = np.empty((BINS + 1, 1))  # a copy of other's column: raising it must leave ``other`` as it was
    for j in range(other.shape[1]):
        for k in range(BINS + 1):
            o[k, 0] = other[k, j]
        top = max(state[0, j], o[0, 0])
        _raise_column(state, j, top)
        _raise_column(o, 0, top)
        for k in range(1, BINS + 1):
            state[k, j] += o[k, 0]


def value(state: np.ndarray) -> np.ndarray:
    """The sum a state holds, rounded to float64 (bins added top down: the same bits for the same state).

    Examples
    --------
    >>> value(deposit(zeros(2), np.array([2.0, -0.5]))).tolist()
    [2.0, -0.5]
    """
    out: np.ndarray = state[1].copy()
    for k in range(2, BINS + 1):
        out += state[k]
    return out
