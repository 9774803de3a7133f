"""Key-value pull and push (storage._keys and the shard's key ops) against numpy oracles.

The oracle of every key op is the dense op with the untouched entries set to zero: a sparse push must give
the very same floats (assert_array_equal, not allclose), since the runs compare sparse and dense iterates.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief import models
from distbelief.errors import InvalidOptionError, ProtocolError
from distbelief.storage import Layout, Shard
from distbelief.storage._keys import (
    compact_batch,
    compact_portion,
    compact_rows,
    kv_bytes,
    split_keys,
    union_keys,
    use_sparse,
    whole_slice_is_smaller,
)


@st.composite
def slices_and_keys(draw: Any) -> tuple[int, int, np.ndarray, np.random.Generator]:
    lo = draw(st.integers(0, 50))
    size = draw(st.integers(1, 60))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    density = draw(st.floats(0.0, 1.0))
    keys = np.flatnonzero(rng.random(size) < density).astype(np.int32)
    return lo, size, keys, rng


def _shard(lo: int, size: int, rng: np.random.Generator) -> Shard:
    s = Shard(0, lo, lo + size)
    s.set("x", lo, lo + size, rng.normal(size=size))
    return s


@given(slices_and_keys())
def test_gather_is_numpy_fancy_indexing(case: tuple[int, int, np.ndarray, np.random.Generator]) -> None:
    lo, size, keys, rng = case
    s = _shard(lo, size, rng)
    np.testing.assert_array_equal(s.gather("x", keys), s.get("x")[keys])


def test_gather_refuses_keys_outside_the_slice() -> None:
    s = _shard(10, 4, np.random.default_rng(0))
    with pytest.raises(InvalidOptionError, match="outside"):
        s.gather("x", np.array([4], dtype=np.int32))


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
@given(case=slices_and_keys(), pushes=st.integers(1, 4), scale=st.booleans())
def test_push_at_keys_equals_a_dense_push_with_zeros_elsewhere(
    rule: str, case: tuple[int, int, np.ndarray, np.random.Generator], pushes: int, scale: bool
) -> None:
    lo, size, keys, rng = case
    sparse, dense = _shard(lo, size, rng), Shard(0, lo, lo + size)
    dense.set("x", lo, lo + size, sparse.get("x"))
    for seq in range(pushes):
        k = keys[rng.random(keys.size) < 0.7]  # each push its own subset of the keys
        g = rng.normal(size=k.size)
        full = np.zeros(size)
        full[k] = g
        kw: dict[str, Any] = {"source": "r", "seq": seq, "rule": rule, "lr": 0.1, "fetched_version": 0}
        kw["staleness_scale"] = scale
        assert sparse.push(g, keys=k, **kw) == dense.push(full, **kw)
        np.testing.assert_array_equal(sparse.get("x"), dense.get("x"))
        if rule == "adagrad":
            np.testing.assert_array_equal(sparse.get("x.adagrad"), dense.get("x.adagrad"))
    # A retried key-value push is refused, as a dense one.
    assert not sparse.push(np.ones(keys.size), keys=keys, source="r", seq=0, rule=rule, lr=0.1)[0]


def test_push_at_refuses_mismatched_keys_and_values() -> None:
    s = _shard(0, 4, np.random.default_rng(0))
    with pytest.raises(InvalidOptionError, match="key-value push"):
        s.push(np.ones(2), keys=np.array([1], dtype=np.int32), source="r", seq=0, rule="sgd", lr=0.1)


@given(n=st.integers(1, 500), shards=st.integers(1, 6), density=st.floats(0, 1), seed=st.integers(0, 2**31))
@settings(max_examples=60)
def test_split_keys_cuts_at_the_layout(n: int, shards: int, density: float, seed: int) -> None:
    layout = Layout.split(n, min(shards, n), target_chunk=7)
    keys = np.flatnonzero(np.random.default_rng(seed).random(n) < density)
    parts = split_keys(layout.bounds, keys)
    assert len(parts) == layout.shards
    for (lo, hi), local in zip(layout.ranges(), parts, strict=True):
        assert local.dtype == np.int32
        assert ((local >= 0) & (local < hi - lo)).all()
    back = [p + lo for p, (lo, _) in zip(parts, layout.ranges(), strict=True)]
    np.testing.assert_array_equal(np.concatenate(back), keys)
    assert kv_bytes(*parts) == 4 * keys.size


def test_union_keys() -> None:
    assert union_keys([]).size == 0
    assert union_keys([np.array([3, 9]), np.array([1, 3])]).tolist() == [1, 3, 9]


MODELS = [
    models.Logistic(40),
    models.Logistic(40, fit_intercept=False),
    models.LeastSquares(40),
    models.Softmax(40, 3),
    models.Softmax(40, 3, fit_intercept=False),
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"{m.spec['kind']}-{m.spec['fit_intercept']}")
@given(rows=st.integers(1, 30), density=st.floats(0.0, 0.3), seed=st.integers(0, 2**31))
@settings(max_examples=30)
def test_compact_portion_gives_the_full_gradient_at_its_keys(
    model: Any, rows: int, density: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    X = sp.random_array((rows, 40), density=density, format="csr", rng=rng)
    X.data = rng.normal(size=X.nnz)
    softmax = model.spec["kind"] == "softmax"
    y = rng.integers(0, 3, rows).astype(float) if softmax else rng.random(rows).round()
    w = rng.normal(size=model.n_params)
    part = compact_portion(model, X, y)
    loss, grad = model.loss_and_grad(w, X, y)
    c_loss, c_grad = part.model.loss_and_grad(w[part.keys], part.X, part.y)
    assert part.keys.dtype == np.int64 and (np.diff(part.keys) > 0).all()
    assert c_loss == pytest.approx(loss, rel=1e-13, abs=1e-13)
    np.testing.assert_allclose(c_grad, grad[part.keys], rtol=1e-13, atol=1e-13)
    outside = np.ones(model.n_params, bool)
    outside[part.keys] = False
    assert not grad[outside].any()  # the keys are every parameter the rows move


def test_compact_portion_gives_bit_equal_gradients_for_the_compiled_logistic_kernel() -> None:
    rng = np.random.default_rng(1)
    X = sp.random_array((200, 1 << 12), density=0.01, format="csr", rng=rng)
    X.data = rng.normal(size=X.nnz)
    model = models.Logistic(1 << 12)
    y = rng.random(200).round()
    w = rng.normal(size=model.n_params)
    part = compact_portion(model, X, y)
    loss, grad = model.loss_and_grad(w, X, y)
    c_loss, c_grad = part.model.loss_and_grad(w[part.keys], part.X, part.y)
    assert c_loss == loss
    np.testing.assert_array_equal(c_grad, grad[part.keys])


def test_use_sparse_resolves_the_mode() -> None:
    logistic = models.Logistic(3)
    assert use_sparse("auto", logistic, True) and not use_sparse("auto", logistic, False)
    assert not use_sparse("dense", logistic, True)
    assert not use_sparse("auto", models.MLP([3, 4, 2]), True)
    with pytest.raises(InvalidOptionError, match="needs a sparse"):
        use_sparse("sparse", logistic, False)
    with pytest.raises(InvalidOptionError, match="communication must be"):
        use_sparse("fast", logistic, True)


@given(size=st.integers(1, 300), covered=st.floats(0, 1), rows=st.sampled_from([1, 4]), wide=st.booleans())
@settings(max_examples=40)
def test_the_whole_slice_is_chosen_exactly_when_it_moves_fewer_bytes(
    size: int, covered: float, rows: int, wide: bool
) -> None:
    """The oracle: the bytes of both messages as they travel (keys and values against the whole slice)."""
    keys = np.arange(int(covered * size), dtype=np.int64 if wide else np.int32)
    kv = kv_bytes(keys, np.zeros((rows, keys.size)))
    whole = kv_bytes(np.zeros((rows, size)))
    assert whole_slice_is_smaller(keys, size, rows) == (whole < kv)


def test_coverage_thresholds_are_two_thirds_for_a_pull_and_eight_ninths_for_a_binned_push() -> None:
    keys = np.arange(900, dtype=np.int32)
    assert not whole_slice_is_smaller(keys[:600], 900) and whole_slice_is_smaller(keys[:601], 900)
    assert not whole_slice_is_smaller(keys[:800], 900, 4) and whole_slice_is_smaller(keys[:801], 900, 4)


def test_a_whole_slice_pull_is_a_copy_of_the_slice() -> None:
    s = Shard(0, 10, 14)
    s.set("x", 10, 14, np.arange(4.0))
    got = s.gather("x", None)
    got[0] = 99.0
    assert s.get("x").tolist() == [0.0, 1.0, 2.0, 3.0]


@given(case=slices_and_keys(), n_portions=st.integers(1, 6), data=st.data())
def test_ordered_accumulation_adds_the_portions_in_their_order(
    case: tuple[int, int, np.ndarray, np.random.Generator], n_portions: int, data: Any
) -> None:
    """Parts in any arrival order and any grouping into messages, backup copies among them: the sum is
    ``((g_0 + g_1) + g_2) + ...`` (numpy's elementwise adds, the oracle), and each portion counts once."""
    lo, size, keys, rng = case
    grads = []
    for _ in range(n_portions):
        k = keys[rng.random(keys.size) < 0.6]
        grads.append((k, rng.normal(size=k.size) * 10.0 ** rng.integers(-8, 9, size=k.size)))
    want = np.zeros(size)
    for k, g in grads:
        full = np.zeros(size)
        full[k] = g
        want = want + full
    shard = Shard(0, lo, lo + size)
    shard.reset_accumulator("acc", 5, expected=n_portions, finalize=[("settle", "acc")], ordered=True)
    order = data.draw(st.permutations(range(n_portions)))
    copies = data.draw(st.lists(st.sampled_from(range(n_portions)), max_size=3))  # backups, retried pushes
    arrivals = [*order[:1], *copies, *order[1:]]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(arrivals)), max_size=3)))
    finals = []
    for a, b in itertools.pairwise([0, *cuts, len(arrivals)]):
        batch = list(dict.fromkeys(arrivals[a:b]))  # one message holds a portion once
        if batch:
            # A whole slice (None) where the keys cover it densely, as the replicas send it.
            parts = [
                (None, _dense(size, *grads[p])) if grads[p][0].size * 3 > size * 2 else grads[p]
                for p in batch
            ]
            finals.append(shard.push_parts("acc", parts, batch, epoch=5)[1])
    assert [f for f in finals if f is not None] == [[n_portions]]  # finalized once, by the last new portion
    np.testing.assert_array_equal(shard.get("acc"), want)
    assert shard.accumulators["acc"].binned is None  # no 4-float-an-element state


def _dense(size: int, k: np.ndarray, g: np.ndarray) -> np.ndarray:
    full = np.zeros(size)
    full[k] = g
    return full


def test_ordered_accumulation_refuses_sums_and_mismatched_parts() -> None:
    shard = Shard(0, 0, 4)
    shard.reset_accumulator("acc", 1, expected=2, ordered=True)
    with pytest.raises(ProtocolError, match="in order"):
        shard.accumulate("acc", np.ones(4), [0, 1], epoch=1)
    with pytest.raises(InvalidOptionError, match="one each"):
        shard.push_parts("acc", [(None, np.ones(4))], [0, 1], epoch=1)
    with pytest.raises(InvalidOptionError, match="3 keys"):
        shard.push_parts("acc", [(np.array([0, 1, 2]), np.ones(2))], [0], epoch=1)
    with pytest.raises(InvalidOptionError, match="sorted, unique"):
        shard.push_parts("acc", [(np.array([2, 1]), np.ones(2))], [0], epoch=1)
    assert not shard.accumulators["acc"].covered and not shard.accumulators["acc"].solos  # nothing taken
    # A stale evaluation's parts change nothing.
    assert shard.push_parts("acc", [(None, np.ones(4))], [0], epoch=0) == (False, None)
    np.testing.assert_array_equal(shard.get("acc"), np.zeros(4))


@given(st.lists(st.integers(0, 300), max_size=60), st.integers(301, 20_000))
def test_distinct_columns_by_mark_or_sort_equal_numpys_unique(indices: list[int], width: int) -> None:
    from distbelief.storage._keys import _distinct_columns

    a = np.array(indices, dtype=np.int32)
    cols, at = _distinct_columns(a, width)  # a wide table: the sort; a narrow one (width ~ 16 x): the mark
    want, inverse = np.unique(a, return_inverse=True)
    np.testing.assert_array_equal(cols, want)
    np.testing.assert_array_equal(at, inverse.ravel())


@given(
    n_rows=st.integers(1, 40),
    width=st.integers(1, 300),
    density=st.floats(0.0, 0.3),
    outputs=st.sampled_from([(1, False), (1, True), (3, True)]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_compact_batch_is_compact_rows_of_the_batch(
    n_rows: int, width: int, density: float, outputs: tuple[int, bool], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    X = sp.random_array((n_rows, width), density=density, random_state=rng, format="csr")
    y = rng.normal(size=n_rows)
    rows = rng.permutation(n_rows)[: max(1, n_rows // 2)]
    layout = (width, outputs[0], outputs[1])
    table = np.full(width, -1, dtype=np.int32)
    got = compact_batch(layout, X, y, rows, table)
    want = compact_rows(layout, X[rows], y[rows])
    # The same keys, each distinct, in the order the rows first touch their columns (not sorted); column j
    # of X holds the key keys[j]'s column: scattered back to the full width, both are the rows themselves.
    np.testing.assert_array_equal(np.sort(got.keys), want.keys)
    assert np.unique(got.keys).size == got.keys.size
    assert got.n_columns == want.n_columns and got.X.shape == want.X.shape
    k = outputs[0]
    full = np.zeros((rows.size, width))
    full[:, got.keys[: got.n_columns * k : k] // k] = got.X.toarray()[:, : got.n_columns]
    np.testing.assert_array_equal(full, X[rows].toarray())
    np.testing.assert_array_equal(got.y, want.y)
    # Each row keeps its nonzeros in their order (the compact kernels add the same products in that order).
    np.testing.assert_array_equal(got.X.data, X[rows].data)
    assert (table == -1).all()  # the scratch table is handed back clean


@given(
    n_rows=st.integers(1, 30),
    width=st.integers(1, 300),
    density=st.floats(0.0, 0.4),
    outputs=st.sampled_from([(1, False), (1, True), (3, True)]),
    n_batches=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_rows_keys_are_the_sorted_union_of_the_batches_keys(
    n_rows: int, width: int, density: float, outputs: tuple[int, bool], n_batches: int, seed: int
) -> None:
    from distbelief.storage.internal import rows_keys

    rng = np.random.default_rng(seed)
    X = sp.random_array((n_rows, width), density=density, random_state=rng, format="csr")
    batches = [(X, rng.permutation(n_rows)[: rng.integers(1, n_rows + 1)]) for _ in range(n_batches)]
    layout = (width, outputs[0], outputs[1])
    mask = np.zeros(width, dtype=bool)
    got = rows_keys(layout, batches, mask)
    want = union_keys([compact_rows(layout, X[rows], np.zeros(rows.size)).keys for _, rows in batches])
    assert got is not None
    np.testing.assert_array_equal(got, want)
    assert not mask.any()  # handed back clean
