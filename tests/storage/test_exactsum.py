"""Reproducible summation (storage._exactsum): any order and grouping of the same terms, the same bits."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.storage import _exactsum as xs

N = 5
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
terms_strategy = st.lists(st.lists(floats, min_size=N, max_size=N), min_size=1, max_size=12)


def _sum_grouped(terms: list[np.ndarray], order: list[int], cuts: list[int]) -> np.ndarray:
    """Deposit the terms in ``order``, in groups cut at ``cuts``, each group its own state, merged."""
    total = xs.zeros(N)
    bounds = [0, *sorted(set(cuts)), len(order)]
    for a, b in itertools.pairwise(bounds):
        part = xs.zeros(N)
        for k in order[a:b]:
            xs.deposit(part, terms[k])
        xs.merge(total, part)
    return xs.value(total)


@settings(max_examples=300, deadline=None)
@given(terms_strategy, st.randoms(use_true_random=False), st.data())
def test_any_permutation_and_grouping_gives_the_same_bits(raw, rnd, data) -> None:  # type: ignore[no-untyped-def]
    terms = [np.array(t) for t in raw]
    reference = _sum_grouped(terms, list(range(len(terms))), [])
    order = list(range(len(terms)))
    rnd.shuffle(order)
    cuts = data.draw(st.lists(st.integers(0, len(terms)), max_size=4))
    again = _sum_grouped(terms, order, cuts)
    assert np.array_equal(again, reference, equal_nan=True)


@settings(max_examples=300, deadline=None)
@given(terms_strategy)
def test_the_sum_is_as_accurate_as_float64_allows(raw) -> None:  # type: ignore[no-untyped-def]
    terms = np.array(raw)
    got = _sum_grouped(list(terms), list(range(len(terms))), [])
    for i in range(N):
        col = terms[:, i]
        if np.max(np.abs(col)) >= 2.0**xs.LIMIT_EXP:
            continue  # counted as infinite (tested below)
        exact = math.fsum(col)
        # Bits below 2**-64 of the largest term (at its bin's floor) are dropped, plus float64 rounding.
        bound = 2.0**-63 * 2.0 ** (xs.WIDTH * math.ceil(math.frexp(np.max(np.abs(col)))[1] / xs.WIDTH))
        assert abs(got[i] - exact) <= len(col) * bound + 2 * math.ulp(exact) + 2.0**-990


def test_non_finite_terms_sum_as_floats_do_in_any_order() -> None:
    terms = [np.array([np.inf, np.inf, np.nan, 1.0, 1e300]), np.array([1.0, -np.inf, 2.0, 2.0, 1e300])]
    for order in ([0, 1], [1, 0]):
        s = xs.zeros(N)
        for k in order:
            xs.deposit(s, terms[k])
        out = xs.value(s)
        assert out[0] == np.inf and np.isnan(out[1]) and np.isnan(out[2]) and out[3] == 3.0
        assert out[4] == np.inf  # 2e300 would be finite, but terms >= 2**960 count as overflowed


def test_tiny_terms_keep_their_bits_when_other_terms_are_zero() -> None:
    with_zeros, without = xs.zeros(1), xs.zeros(1)
    for t in (0.0, 3e-200, 0.0, -1e-205):
        xs.deposit(with_zeros, np.array([t]))
        if t:
            xs.deposit(without, np.array([t]))
    assert xs.value(with_zeros)[0] == xs.value(without)[0] == 3e-200 + -1e-205


def test_a_state_costs_four_vectors() -> None:
    assert xs.zeros(10).nbytes == 4 * 8 * 10


# -- the compiled loops against the numpy passes (the reference) -------------------------------------------
any_floats = st.floats(allow_nan=True, allow_infinity=True, width=64)


def _magnitudes(rng: np.random.Generator, n: int) -> np.ndarray:
    """Terms over the whole range: zeros, subnormals, huge, infinities and NaNs among ordinary ones."""
    v = rng.normal(size=n) * 2.0 ** rng.integers(-1070, 1000, size=n).astype(float)
    pick = rng.random(n)
    v[pick < 0.05] = 0.0
    v[(pick >= 0.05) & (pick < 0.07)] = np.inf
    v[(pick >= 0.07) & (pick < 0.08)] = -np.inf
    v[(pick >= 0.08) & (pick < 0.085)] = np.nan
    v[(pick >= 0.085) & (pick < 0.1)] = 5e-324
    return v


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(any_floats, min_size=N, max_size=N), min_size=1, max_size=8))
def test_compiled_deposit_and_merge_leave_the_numpy_states(raw) -> None:  # type: ignore[no-untyped-def]
    numpy_state, compiled_state, merged = xs.zeros(N), xs.zeros(N), xs.zeros(N)
    merge_loop = xs._loop(xs._merge_loop) or xs._merge_numpy  # compiled at any width (when numba is there)
    for t in raw:
        v = np.array(t)
        xs._deposit_numpy(numpy_state, v)
        xs.deposit_at(compiled_state, np.arange(N), v)  # always compiled (when numba is there)
        merge_loop(merged, xs._deposit_numpy(xs.zeros(N), v))
    np.testing.assert_array_equal(compiled_state, numpy_state)
    np.testing.assert_array_equal(merged, numpy_state)


def test_compiled_loops_on_wide_vectors_and_at_positions() -> None:
    rng = np.random.default_rng(7)
    n = 3 * xs.COMPILED_FROM + 5
    terms = [_magnitudes(rng, n) for _ in range(4)] + [rng.normal(size=n) for _ in range(4)]
    reference, wide = xs.zeros(n), xs.zeros(n)
    for v in terms:
        xs._deposit_numpy(reference, v)
        xs.deposit(wide, v)
    np.testing.assert_array_equal(wide, reference)
    # At positions: the state of a dense deposit with zeros elsewhere.
    keys = np.flatnonzero(rng.random(n) < 0.3)
    at, dense = xs.zeros(n), xs.zeros(n)
    for v in terms:
        xs.deposit_at(at, keys, v[keys])
        full = np.zeros(n)
        full[keys] = v[keys]
        xs._deposit_numpy(dense, full)
    # The same columns at the keys and the same sums everywhere (a dense zero term only sets an empty
    # column's unit to the lowest one, which changes no sum).
    np.testing.assert_array_equal(at[:, keys], dense[:, keys])
    np.testing.assert_array_equal(xs.value(at), xs.value(dense))
    assert not np.delete(at, keys, axis=1).any()
    halves = xs.zeros(n)
    xs.merge(halves, xs.deposit(xs.deposit(xs.zeros(n), terms[0]), terms[1]))
    xs.merge(halves, xs.deposit(xs.deposit(xs.zeros(n), terms[2]), terms[3]))
    first4 = xs.zeros(n)
    for v in terms[:4]:
        xs._deposit_numpy(first4, v)
    np.testing.assert_array_equal(halves, first4)


def test_positions_are_checked() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        xs.deposit_at(xs.zeros(3), np.array([3]), np.array([1.0]))
    with pytest.raises(ValueError, match="as many positions"):
        xs.deposit_at(xs.zeros(3), np.array([0, 1]), np.array([1.0]))
