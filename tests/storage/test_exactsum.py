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
    assert xs.state_bytes(10) == 4 * 8 * 10 == xs.zeros(10).nbytes
