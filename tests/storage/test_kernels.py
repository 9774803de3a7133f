"""storage._kernels against numpy's elementwise ufuncs, bit for bit, whatever the cut of a vector.

numpy's ``y + a * x`` rounds the product and the sum of each element alone, on every CPU: it is the oracle.
OpenBLAS's ``daxpy`` differs from it on this project's machines (FMA in the vector's body), which is what
these tests would catch if a kernel went back to BLAS.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.storage import _kernels

#: Sizes on both sides of the compiled path's threshold and of lincomb's block, with odd tails.
SIZES = [1, 7, _kernels.COMPILED_FROM - 1, _kernels.COMPILED_FROM + 13, 2 * _kernels.BLOCK + 5]


def _vectors(n: int, k: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=n) * 10.0 ** rng.integers(-3, 4) for _ in range(k)]


@pytest.mark.parametrize("n", SIZES)
def test_axpy_and_scale_round_as_numpy_elementwise(n: int) -> None:
    x, y = _vectors(n, 2)
    got = y.copy()
    _kernels.axpy(0.37, x, got)
    np.testing.assert_array_equal(got, y + 0.37 * x)
    _kernels.scale(-1.3, got)
    np.testing.assert_array_equal(got, (y + 0.37 * x) * -1.3)


@pytest.mark.parametrize("n", SIZES)
def test_lincomb_rounds_as_the_unfused_loop(n: int) -> None:
    vs = _vectors(n, 4, seed=1)
    coeffs = [0.5, -2.25, 0.0, 1e-3]
    out = np.empty(n)
    _kernels.lincomb(out, coeffs, vs)
    want = 0.5 * vs[0]
    for c, v in zip(coeffs[1:], vs[1:], strict=True):
        if c:
            want = want + c * v
    np.testing.assert_array_equal(out, want)
    # The destination as a term: scaled first, then the others in order.
    dst = vs[0].copy()
    _kernels.lincomb(dst, coeffs[1:], vs[1:], own=0.5)
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("n", SIZES)
def test_adagrad_step_rounds_as_numpy_elementwise(n: int) -> None:
    w, g, acc0 = _vectors(n, 3, seed=2)
    acc0 = np.abs(acc0)
    w_got, acc_got = w.copy(), acc0.copy()
    _kernels.adagrad_step(w_got, g, acc_got, lr=0.1, eps=1e-8)
    acc_want = acc0 + g * g
    np.testing.assert_array_equal(acc_got, acc_want)
    np.testing.assert_array_equal(w_got, w + -0.1 * (g / (np.sqrt(acc_want) + 1e-8)))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("l2", [0.0, 1e-3])
def test_a_downpour_steps_fused_passes_round_as_numpy_elementwise(n: int, l2: float) -> None:
    grad, x, acc0, dx0 = _vectors(n, 4, seed=3)
    g = np.empty(n)
    assert _kernels.scaled_gradient(g, grad, 1 / 128, l2=l2, x=x)
    want = grad * (1 / 128)
    if l2:
        want = want + l2 * x
    np.testing.assert_array_equal(g, want)
    acc, x_got, dx = acc0.copy(), x.copy(), dx0.copy()
    _kernels.accrue_step(g, acc, -0.05, x_got, dx)
    np.testing.assert_array_equal(acc, acc0 + g)
    np.testing.assert_array_equal(x_got, x + -0.05 * g)
    np.testing.assert_array_equal(dx, dx0 + -0.05 * g)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_scaled_gradient_says_when_an_element_is_not_finite(n: int, bad: float) -> None:
    grad, x = _vectors(n, 2, seed=4)
    grad[n // 2] = bad
    assert not _kernels.scaled_gradient(np.empty(n), grad, 0.5, x=x)
    # A finite gradient whose scaled value overflows is caught as well.
    assert not _kernels.scaled_gradient(np.empty(n), np.full(n, 1e308), 10.0, x=x)
    # float32 gradients (a JAX model's) take numpy's path and give float64 bits.
    g = np.empty(n)
    assert _kernels.scaled_gradient(g, x.astype(np.float32), 0.5, x=x)
    np.testing.assert_array_equal(g, x.astype(np.float32).astype(np.float64) * 0.5)


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 3 * _kernels.COMPILED_FROM), max_size=4), a=st.floats(-4, 4))
def test_an_element_gets_the_same_bits_whatever_the_cut(cuts: list[int], a: float) -> None:
    """Chunks (a spilled vector), subsets (a key-value push) and the whole vector agree bit for bit."""
    n = 3 * _kernels.COMPILED_FROM
    x, y = _vectors(n, 2, seed=3)
    whole = y.copy()
    _kernels.axpy(a, x, whole)
    chunked = y.copy()
    bounds = [0, *sorted(set(cuts)), n]
    for lo, hi in itertools.pairwise(bounds):
        _kernels.axpy(a, x[lo:hi], chunked[lo:hi])
    np.testing.assert_array_equal(chunked, whole)
    keys = np.flatnonzero(np.random.default_rng(len(cuts)).random(n) < 0.5)
    subset = y[keys]
    _kernels.axpy(a, x[keys], subset)
    np.testing.assert_array_equal(subset, whole[keys])


def test_memmaps_and_read_only_operands_are_taken(tmp_path: object) -> None:
    n = _kernels.COMPILED_FROM + 3
    x, y = _vectors(n, 2, seed=4)
    x.setflags(write=False)  # as a slice deserialized from a message
    path = f"{tmp_path}/y.f8"
    y.tofile(path)
    mapped = np.memmap(path, dtype=np.float64, mode="r+", shape=(n,))
    _kernels.axpy(2.0, x, mapped)
    np.testing.assert_array_equal(np.asarray(mapped), y + 2.0 * x)


def test_lincomb_refuses_mismatched_terms() -> None:
    with pytest.raises(ValueError, match="as many"):
        _kernels.lincomb(np.zeros(2), [1.0], [])
    with pytest.raises(ValueError, match="at least one"):
        _kernels.lincomb(np.zeros(2), [], [])


@pytest.mark.parametrize("n", SIZES)
def test_add_at_rounds_as_numpy_fancy_add(n: int) -> None:
    rng = np.random.default_rng(5)
    out = rng.normal(size=n)
    keys = np.flatnonzero(rng.random(n) < 0.6)
    values = rng.normal(size=keys.size) * 1e-7
    want = out.copy()
    want[keys] = want[keys] + values
    _kernels.add_at(out, keys, values)
    np.testing.assert_array_equal(out, want)


def test_dots_are_the_block_sums_of_np_dot_and_match_to_rounding() -> None:
    rng = np.random.default_rng(6)
    n = 2 * _kernels.DOT_BLOCK + 17
    hot = [rng.normal(size=n) for _ in range(3)]
    cold = [rng.normal(size=n) for _ in range(5)]
    pairs = [(h, c) for h in hot for c in cold] + [(h, h) for h in hot]
    got = _kernels.dots(pairs)
    for (a, b), value in zip(pairs, got, strict=True):
        blocks = [float(np.dot(a[i : i + _kernels.DOT_BLOCK], b[i : i + _kernels.DOT_BLOCK])) for i in
                  range(0, n, _kernels.DOT_BLOCK)]  # fmt: skip
        assert value == sum(blocks)  # the block sums, added in block order
        assert value == pytest.approx(float(np.dot(a, b)), rel=1e-12, abs=1e-9)
    assert _kernels.dots(pairs) == got  # the same bits again
    assert _kernels.dots([]) == []


@pytest.mark.parametrize("n", [0, 1, 31, _kernels.DOT_BLOCK])
def test_short_dots_are_np_dot_bit_for_bit(n: int) -> None:
    # Up to DOT_BLOCK elements a product is one np.dot, on contiguous vectors and on strided views alike.
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(3, 2 * n)) * 10.0 ** rng.integers(-3, 4, size=(3, 1))
    vectors = [rows[0, :n], rows[1, ::2], rows[2, n:]]
    pairs = [(a, b) for a in vectors for b in vectors]
    got = _kernels.dots(pairs)
    assert got == [float(np.dot(a, b)) for a, b in pairs]
    assert all(type(value) is float for value in got)


def test_norm_inf_without_a_temporary() -> None:
    x = np.array([1.0, -7.5, 3.0])
    assert _kernels.norm_inf(x) == 7.5
    assert _kernels.norm_inf(np.zeros(0)) == 0.0
    assert np.isnan(_kernels.norm_inf(np.array([1.0, np.nan, -2.0])))


def test_the_compiled_l1_kernels_equal_the_numpy_expressions() -> None:
    from distbelief.storage import _l1

    rng = np.random.default_rng(8)
    n = _kernels.COMPILED_FROM + 101
    special = np.array([0.0, -0.0, np.nan, 1e-300, -1e-300, np.inf, -np.inf, 2.0, -2.0])

    def draw() -> np.ndarray:
        v = rng.normal(size=n) * 10.0 ** rng.integers(-5, 5, size=n)
        v[rng.random(n) < 0.3] = 0.0
        v[: special.size] = special
        return rng.permuted(v)

    g, x, v, d = draw(), draw(), draw(), draw()
    l1, free = 0.7, [(10, 20), (n - 5, n)]
    want = np.subtract(g, np.clip(g, -l1, l1))
    moved = x != 0.0
    want[moved] = g[moved] + l1 * np.sign(x[moved])
    for a, b in free:
        want[a:b] = g[a:b]
    np.testing.assert_array_equal(_l1.pseudo_gradient(g, x, l1, free), want)
    np.testing.assert_array_equal(_l1.orthant(x, v), np.sign(np.where(x != 0.0, x, -v)) + 0.0)
    assert not np.signbit(_l1.orthant(x, v)[_l1.orthant(x, v) == 0.0]).any()  # no -0.0
    got, want_d = d.copy(), d.copy()
    _l1.sign_align(got, v)
    want_d[want_d * np.sign(v) >= 0.0] = 0.0
    np.testing.assert_array_equal(got, want_d)
    xi = _l1.orthant(x, g)
    got_x, want_x = v.copy(), v.copy()
    _l1.project_orthant(got_x, xi, free)
    left = np.sign(want_x) != xi
    for a, b in free:
        left[a:b] = False
    want_x[left] = 0.0
    np.testing.assert_array_equal(got_x, want_x)
    finite = np.where(np.isfinite(x), x, 1.0)
    kept = np.abs(finite)
    for a, b in free:
        kept[a:b] = 0.0
    # Blocks of numpy's sum, added in order: the same sum to rounding, no temporary of the vector's size.
    assert _l1.norm1(finite, free) == pytest.approx(float(kept.sum()), rel=1e-13)
    assert _l1.norm1(finite, [(0, n)]) == 0.0


@pytest.mark.parametrize(
    "k", [1, 7, _kernels.ACCRUE_AT_COMPILED_FROM - 1, _kernels.ACCRUE_AT_COMPILED_FROM + 3, 5000]
)
def test_a_sparse_downpour_steps_pass_at_its_keys_rounds_as_numpy_elementwise(k: int) -> None:
    n = 3 * k + 11
    rng = np.random.default_rng(k)
    keys = np.sort(rng.choice(n, size=k, replace=False))
    g, acc0, x0, dx0 = _vectors(n, 4, seed=4)
    g = g[:k]
    acc, x, dx = acc0.copy(), x0.copy(), dx0.copy()
    _kernels.accrue_at(keys, g, acc, -0.05, x, dx)
    want_acc, want_x, want_dx = acc0.copy(), x0.copy(), dx0.copy()
    want_acc[keys] = acc0[keys] + g
    want_x[keys] = x0[keys] + -0.05 * g
    want_dx[keys] = dx0[keys] + -0.05 * g
    np.testing.assert_array_equal(acc, want_acc)  # and untouched elsewhere
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(dx, want_dx)
    # Without dx (a windowed replica keeps no unsent-steps vector): the same acc and x.
    acc, x = acc0.copy(), x0.copy()
    _kernels.accrue_at(keys, g, acc, -0.05, x, None)
    np.testing.assert_array_equal(acc, want_acc)
    np.testing.assert_array_equal(x, want_x)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_a_steps_rows_are_added_nonzero_by_nonzero_in_their_order(
    compiled: bool, index_dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    # accrue_rows and add_rows_at_positions (a linear model's Downpour step, straight from its rows), the
    # compiled loops and the numpy fallback, against a plain loop that rounds as numpy's elementwise ops do.
    import scipy.sparse as sp

    if not compiled:
        monkeypatch.setattr(_kernels, "compiled", lambda fn: None)
    rng = np.random.default_rng(3)
    X = sp.random_array((40, 30), density=0.3, random_state=rng, format="csr")
    X.indptr, X.indices = X.indptr.astype(index_dtype), X.indices.astype(index_dtype)
    rows = np.array([5, 3, 3, 17, 0, 39], dtype=np.int64)  # any order, a row twice: columns shared
    r = rng.normal(size=rows.size)
    acc0, x0 = _vectors(30, 2, seed=9)
    positions = np.where(rng.random(30) < 0.5, np.arange(30), -1)
    out0 = rng.normal(size=30)
    acc, x, out = acc0.copy(), x0.copy(), out0.copy()
    _kernels.accrue_rows(X, rows, r, acc, -0.05, x)
    _kernels.add_rows_at_positions(out, positions, X, rows, r, -0.05)
    want_acc, want_x, want_out = acc0.copy(), x0.copy(), out0.copy()
    for i, row in enumerate(rows):
        for t in range(X.indptr[row], X.indptr[row + 1]):
            c, g = X.indices[t], r[i] * X.data[t]
            want_acc[c] = want_acc[c] + g
            want_x[c] = want_x[c] + -0.05 * g
            if positions[c] >= 0:
                want_out[positions[c]] = want_out[positions[c]] + -0.05 * g
    for got, want in ((acc, want_acc), (x, want_x), (out, want_out)):
        np.testing.assert_array_equal(got, want)
    assert (out != out0).any() and (out == out0).any()  # held and not held columns both exercised


@pytest.mark.parametrize("k", [3, _kernels.ACCRUE_AT_COMPILED_FROM + 3, 5000])
def test_add_at_positions_adds_only_where_a_key_is_held(k: int) -> None:
    n = 2 * k + 5
    rng = np.random.default_rng(k)
    held = np.sort(rng.choice(n, size=k, replace=False))
    positions = np.full(n, -1, dtype=np.int64)
    positions[held] = np.arange(k)
    keys = np.sort(rng.choice(n, size=k, replace=False))
    values = rng.normal(size=k)
    out0 = rng.normal(size=k)
    out = out0.copy()
    _kernels.add_at_positions(out, positions, keys, values)
    want = out0.copy()
    for key, v in zip(keys, values, strict=True):
        if positions[key] >= 0:
            want[positions[key]] = want[positions[key]] + v
    np.testing.assert_array_equal(out, want)
    assert np.isin(keys, held).any() and not np.isin(keys, held).all()  # both cases were exercised


@pytest.mark.parametrize("k", [1, _kernels.ACCRUE_AT_COMPILED_FROM + 3, 5000])
def test_keyed_adagrad_and_axpy_round_as_the_whole_vector_kernels_at_those_keys(k: int) -> None:
    n = 2 * k + 3
    rng = np.random.default_rng(k)
    keys = np.sort(rng.choice(n, size=k, replace=False))
    w0, acc0, g_full = _vectors(n, 3, seed=5)
    acc0 = np.abs(acc0)
    g_full[np.setdiff1d(np.arange(n), keys)] = 0.0
    w, acc = w0.copy(), acc0.copy()
    _kernels.adagrad_step_at(w, g_full[keys], acc, keys, lr=0.1, eps=1e-8)
    w_want, acc_want = w0.copy(), acc0.copy()
    _kernels.adagrad_step(w_want, g_full, acc_want, lr=0.1, eps=1e-8)  # zero gradient: nothing moves
    np.testing.assert_array_equal(w, w_want)
    np.testing.assert_array_equal(acc, acc_want)
    y = w0.copy()
    _kernels.axpy_at(-0.3, g_full[keys], y, keys)
    y_want = w0.copy()
    _kernels.axpy(-0.3, g_full, y_want)
    np.testing.assert_array_equal(y, y_want)


# -- mixed precision (float32 L-BFGS history, issue 29) ----------------------------------------------------


def _upcast(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float64)


@pytest.mark.parametrize("n", [*SIZES, 2 * _kernels.DOT_BLOCK + 17])
def test_mixed_dots_accumulate_the_upcast_values_in_float64(n: int) -> None:
    rng = np.random.default_rng(9)
    s = rng.normal(size=n).astype(np.float32)
    y = rng.normal(size=n).astype(np.float32)
    g, d = rng.normal(size=n), rng.normal(size=n)
    pairs: list[tuple[np.ndarray, np.ndarray]] = [(s, g), (g, y), (s, y), (s, s), (g, g), (g, d)]
    got = _kernels.dots_mixed(pairs)
    for (a, b), value in zip(pairs, got, strict=True):
        # The oracle: numpy's float64 dot of the upcast vectors. The compiled loop sums in another order.
        assert value == pytest.approx(float(np.dot(_upcast(a), _upcast(b))), rel=1e-12, abs=1e-12 * n)
    # A pair of float64 vectors gets the bits it gets without float32 company (the same code path).
    assert got[4:] == _kernels.dots([(g, g), (g, d)])
    assert _kernels.dots_mixed(pairs) == got  # the same bits again
    # Each mixed pair is the sum of its blocks' dot_mixed, in block order.
    blocks = range(0, n, _kernels.DOT_BLOCK) if n > _kernels.DOT_BLOCK else [0]
    total = 0.0
    for lo in blocks:
        total += _kernels.dot_mixed(s[lo : lo + _kernels.DOT_BLOCK], g[lo : lo + _kernels.DOT_BLOCK])
    assert got[0] == (total if n > _kernels.DOT_BLOCK else _kernels.dot_mixed(s, g))


@pytest.mark.parametrize("n", [8, _kernels.COMPILED_FROM + 8])
def test_a_float32_dot_does_not_accumulate_in_float32(n: int) -> None:
    # Every product after the first, 2**-30, is below float32's resolution next to 1.
    a = np.full(n, 2.0**-15, dtype=np.float32)
    a[0] = 1.0
    want = 1.0 + (n - 1) * 2.0**-30
    assert _kernels.dots_mixed([(a, a)]) == [want]
    assert float(np.dot(a, a)) != want  # what numpy's float32 dot gives


@pytest.mark.parametrize("n", SIZES)
def test_float32_terms_and_destinations_round_once(n: int) -> None:
    vs = _vectors(n, 4, seed=10)
    narrow = [v.astype(np.float32) for v in vs[:2]]
    coeffs = [0.5, -2.25, 1e-3, 3.0]
    terms = [narrow[0], vs[2], narrow[1], vs[3]]
    want = 0.5 * _upcast(terms[0])
    for c, v in zip(coeffs[1:], terms[1:], strict=True):
        want = want + c * _upcast(v)  # numpy elementwise in float64: the oracle, bit for bit
    out = np.empty(n)
    _kernels.lincomb(out, coeffs, terms)
    np.testing.assert_array_equal(out, want)
    # A float32 destination gets the float64 result rounded once, not its partial sums rounded.
    out32 = np.empty(n, dtype=np.float32)
    _kernels.lincomb(out32, coeffs, terms)
    np.testing.assert_array_equal(out32, want.astype(np.float32))
    own = narrow[1].copy()
    _kernels.lincomb(own, [2.0], [vs[0]], own=-1.5)
    np.testing.assert_array_equal(own, (-1.5 * _upcast(narrow[1]) + 2.0 * vs[0]).astype(np.float32))
    # y = g_new - g of two close gradients: rounding g_new to float32 first would lose most digits.
    g_new = vs[0] + 1e-6 * vs[1]
    y = np.empty(n, dtype=np.float32)
    _kernels.lincomb(y, [1.0, -1.0], [g_new, vs[0]])
    np.testing.assert_array_equal(y, (g_new - vs[0]).astype(np.float32))
    got = vs[1].copy()
    _kernels.axpy(0.37, narrow[0], got)
    np.testing.assert_array_equal(got, vs[1] + 0.37 * _upcast(narrow[0]))
    got32 = narrow[0].copy()
    _kernels.scale(-1.3, got32)
    np.testing.assert_array_equal(got32, (_upcast(narrow[0]) * -1.3).astype(np.float32))


def test_mixed_precision_makes_no_temporary_of_a_whole_vector() -> None:
    import tracemalloc

    n = 8 * _kernels.BLOCK  # 8 Mi bytes a float64 vector, 4 Mi a float32 one
    rng = np.random.default_rng(11)
    s = rng.normal(size=n).astype(np.float32)
    g = rng.normal(size=n)
    out32 = np.empty(n, dtype=np.float32)
    out = np.empty(n)
    pairs: list[tuple[np.ndarray, np.ndarray]] = [(s, g), (s, s), (g, g)]
    # The same calls once before the count: each compiles its kernels (numba's allocations, and its cache
    # is cold on a fresh machine) before tracemalloc starts.
    _kernels.dots_mixed(pairs)
    _kernels.lincomb(out32, [1.0, -1.0], [g, s])
    _kernels.lincomb(out, [2.0, 1.0], [s, g])
    # tracemalloc counts every thread's allocations: a session cluster's threads (comms, heartbeats) may
    # allocate during one count, so the smallest of three counts is the calls' own.
    peaks = []
    for _ in range(3):
        tracemalloc.start()
        try:
            _kernels.dots_mixed(pairs)
            _kernels.lincomb(out32, [1.0, -1.0], [g, s])
            _kernels.lincomb(out, [2.0, 1.0], [s, g])
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    # A block of scratch (1 MiB) at most, not a float64 copy of s (8 MiB) nor a float32 one (4 MiB).
    assert min(peaks) <= 8 * _kernels.BLOCK + 65536, peaks


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**16), density=st.floats(0.0, 1.0))
def test_take_at_returns_the_nonzero_entries_at_the_keys_and_clears_them(
    n: int, seed: int, density: float
) -> None:
    # Past ACCRUE_AT_COMPILED_FROM keys the compiled loop runs, below it numpy: both against numpy by hand.
    rng = np.random.default_rng(seed)
    acc = np.where(rng.random(n) < density, rng.normal(size=n), 0.0)
    keys = rng.permutation(n)[: rng.integers(0, n + 1)]
    want_keys = keys[acc[keys] != 0]
    want_values = acc[want_keys].copy()
    want_acc = acc.copy()
    want_acc[keys] = 0.0
    got_keys, got_values = _kernels.take_at(keys, acc)
    np.testing.assert_array_equal(got_keys, want_keys)
    np.testing.assert_array_equal(got_values, want_values)
    np.testing.assert_array_equal(acc, want_acc)
