"""Strom's threshold compression (downpour._compress) against numpy oracles, and the fused push and fetch.

The residual step is pure numpy: tested alone against a direct numpy loop (bit for bit), and for the
invariant that nothing is lost (sent + residual == sum of gradients, exactly, with dyadic gradients whose
additions are exact). Then the replica core with compressed and fused pushes against in-process shards, for
any interleaving (tests/downpour/_helpers.Simulator).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief import models
from distbelief.downpour import Compression, ReplicaCore, sequential_sgd
from distbelief.downpour._compress import ThresholdCompressor, check_compression, encode, signed_bytes
from distbelief.errors import InvalidOptionError
from distbelief.storage import Shard, train_test_split_digits
from distbelief.storage._keys import decode_signs, encode_signs
from tests.downpour._helpers import ConstantGradient, Simulator, plan_batches

X_TR, Y_TR, _, _ = train_test_split_digits(seed=0)
X_SMALL, Y_SMALL = X_TR[:160], Y_TR[:160]


def sent_vector(comp: ThresholdCompressor, idx: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """The dense vector that ``comp.add``'s ``(idx, negative)`` stands for: ``+/-tau`` at ``idx``."""
    out = np.zeros_like(comp.residual)
    out[idx] = np.where(negative, -comp.tau, comp.tau)
    return out


# -- the residual step alone -------------------------------------------------------------------------------
@given(
    n=st.integers(0, 40),
    pushes=st.integers(1, 6),
    tau_exp=st.integers(-3, 2),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=40, deadline=None)
def test_nothing_is_lost_sent_plus_residual_is_the_sum_of_gradients(
    n: int, pushes: int, tau_exp: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    tau = 2.0**tau_exp
    # Dyadic gradients (multiples of 1/8, small): every addition and subtraction below is exact.
    grads = rng.integers(-40, 41, size=(pushes, n)) / 8.0
    comp = ThresholdCompressor(n, Compression(tau=tau))
    sent = np.zeros(n)
    for g in grads:
        before = comp.residual + g
        idx, negative = comp.add(g)
        # Exactly the entries at or past the threshold go, each as +/-tau with the residual's sign.
        np.testing.assert_array_equal(idx, np.flatnonzero(np.abs(before) >= tau))
        np.testing.assert_array_equal(negative, before[idx] < 0)
        step = sent_vector(comp, idx, negative)
        sent += step
        np.testing.assert_array_equal(comp.residual, before - step)
    np.testing.assert_array_equal(sent + comp.residual, grads.sum(axis=0))


@given(n=st.integers(1, 30), seed=st.integers(0, 2**31), tau=st.floats(1e-3, 10.0))
@settings(max_examples=30, deadline=None)
def test_the_residual_step_matches_a_numpy_loop_bit_for_bit(n: int, seed: int, tau: float) -> None:
    rng = np.random.default_rng(seed)
    grads = rng.normal(scale=tau, size=(5, n))
    comp = ThresholdCompressor(n, Compression(tau=tau))
    r = np.zeros(n)
    for g in grads:
        idx, negative = comp.add(g)
        r = r + g
        mask = np.abs(r) >= tau
        quantum = np.where(r < 0, -tau, tau) * mask
        np.testing.assert_array_equal(sent_vector(comp, idx, negative), quantum)
        r = r - quantum
        np.testing.assert_array_equal(comp.residual, r)
        # What is left is below the threshold wherever nothing was sent.
        assert np.all(np.abs(r[~mask]) < tau)


@given(
    n=st.integers(1, 60),
    cuts=st.lists(st.integers(1, 59), max_size=3),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=40, deadline=None)
def test_sign_coded_keys_per_shard_decode_to_the_sent_entries(n: int, cuts: list[int], seed: int) -> None:
    bounds = sorted({0, n, *(c for c in cuts if c < n)})
    rng = np.random.default_rng(seed)
    idx = np.flatnonzero(rng.random(n) < 0.5)
    negative = rng.random(idx.size) < 0.5
    codes = encode(idx, negative, bounds)
    assert len(codes) == len(bounds) - 1 and all(c.dtype == np.int32 for c in codes)
    assert signed_bytes(codes) == 4 * idx.size + 8 * len(codes)
    back_idx, back_neg = [], []
    for lo, c in zip(bounds, codes, strict=False):
        keys, neg = decode_signs(c)
        back_idx.append(keys.astype(np.int64) + lo)
        back_neg.append(neg)
    np.testing.assert_array_equal(np.concatenate(back_idx), idx)
    np.testing.assert_array_equal(np.concatenate(back_neg), negative)


# -- the shard's side ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_a_compressed_push_is_the_key_value_push_of_plus_minus_tau(rule: str) -> None:
    rng = np.random.default_rng(0)
    dense, coded = Shard(0, 10, 30), Shard(0, 10, 30)
    x0 = rng.normal(size=20)
    for s in (dense, coded):
        s.set("x", 10, 30, x0)
    keys = np.array([0, 3, 4, 19], dtype=np.int32)
    negative = np.array([True, False, True, False])
    tau = 0.25
    common: dict[str, Any] = {"source": "r", "seq": 0, "rule": rule, "lr": 0.1}
    dense.push(np.where(negative, -tau, tau), keys=keys, **common)
    assert coded.push(None, keys=encode_signs(keys, negative), tau=tau, **common) == (True, 1, 0)
    np.testing.assert_array_equal(coded.get("x"), dense.get("x"))
    if rule == "adagrad":
        np.testing.assert_array_equal(coded.get("x.adagrad"), dense.get("x.adagrad"))
    # A retried compressed push is applied once.
    assert coded.push(None, keys=encode_signs(keys, negative), tau=tau, **common)[0] is False
    np.testing.assert_array_equal(coded.get("x"), dense.get("x"))


@pytest.mark.parametrize(
    ("grad", "codes", "tau", "match"),
    [
        (None, np.array([1], np.int32), 0.0, "finite tau > 0"),
        (None, np.array([1], np.int32), float("nan"), "finite tau > 0"),
        (None, np.array([1], np.int32), -1.0, "finite tau > 0"),
        (np.ones(1), np.array([1], np.int32), 1.0, "no values"),
        (None, None, 1.0, "no values"),
        (None, np.array([1.0]), 1.0, "signed integers"),
        (None, np.array([-30], np.int32), 1.0, "key-value push"),  # decodes to 29: outside the slice
    ],
)
def test_bad_compressed_pushes_are_refused_and_change_nothing(
    grad: np.ndarray | None, codes: np.ndarray | None, tau: float, match: str
) -> None:
    shard = Shard(0, 0, 5)
    shard.set("x", 0, 5, np.arange(5.0))
    with pytest.raises(InvalidOptionError, match=match):
        shard.push(grad, source="r", seq=0, rule="sgd", lr=0.1, keys=codes, tau=tau)
    np.testing.assert_array_equal(shard.get("x"), np.arange(5.0))
    assert shard.version == 0 and shard.last_seq == {} and shard.applied == 0


@pytest.mark.parametrize("sparse", [False, True])
def test_push_and_fetch_is_a_push_then_a_fetch(sparse: bool) -> None:
    a, b = Shard(0, 4, 10), Shard(0, 4, 10)
    for s in (a, b):
        s.set("x", 4, 10, np.linspace(-1.0, 1.0, 6))
    g = np.arange(6.0)
    kw: dict[str, Any] = {"source": "r", "seq": 3, "rule": "adagrad", "lr": 0.1, "fetched_version": 0}
    fetch_keys = np.array([1, 5], dtype=np.int32) if sparse else None
    answer, (version, (values,)) = a.push_and_fetch(g, ["x"], fetch_keys=fetch_keys, **kw)
    assert answer == b.push(g, **kw) and version == b.version == 1
    expect = b.get("x") if fetch_keys is None else b.gather("x", fetch_keys)
    np.testing.assert_array_equal(values, expect)


# -- options -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tau", [0, -1.0, float("nan"), float("inf"), "0.1", True, None])
def test_bad_thresholds_are_refused(tau: Any) -> None:
    with pytest.raises(InvalidOptionError, match="tau must be a finite number > 0"):
        Compression(tau=tau)


@pytest.mark.parametrize("value", [0.1, "strom", {"tau": 0.1}, True])
def test_compression_must_be_none_or_a_compression(value: Any) -> None:
    with pytest.raises(InvalidOptionError, match=r"compression=.*expected None.*Compression\(tau="):
        check_compression(value)


def test_a_gradient_of_the_wrong_size_is_refused() -> None:
    comp = ThresholdCompressor(3, Compression(tau=1.0))
    with pytest.raises(InvalidOptionError, match="shape"):
        comp.add(np.ones(4))
    np.testing.assert_array_equal(comp.residual, np.zeros(3))


# -- the replica core, compressed and fused, against in-process shards for any timing ---------------------
@given(seed=st.integers(0, 10_000), shards=st.integers(1, 3), n_sync=st.integers(1, 3))
@settings(max_examples=10, deadline=None)
def test_fused_one_replica_sgd_is_sequential_sgd_whatever_the_timing(
    seed: int, shards: int, n_sync: int
) -> None:
    model = models.Softmax(64, 10)
    w0 = model.init_params(seed)
    batches = plan_batches(160, 1, batch_size=16, epochs=1, seed=seed)
    sim = Simulator(
        model, X_SMALL, Y_SMALL, w0, batches, shards=shards, rule="sgd", lr=0.1, seed=seed, l2=1e-3,
        n_fetch=n_sync, n_push=n_sync, fuse=True, trace=True,
    )  # fmt: skip
    sim.run()
    ref = sequential_sgd(model, X_SMALL, Y_SMALL, w0, batches[0], rule="sgd", lr=0.1, l2=1e-3)
    np.testing.assert_allclose(sim.replicas[0].core.losses, ref.losses, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sim.x, ref.x, rtol=1e-10, atol=1e-12)
    c = sim.replicas[0].core.counters
    # Every due push carried the next fetch: one message per shard per push, plus the first fetch (the
    # simulator retries step 0 until it is ready, which may send a second one; unfused: one per step).
    assert c.fused == c.pushes_sent - 1 or c.fused == c.pushes_sent  # the final flush may carry none
    assert shards * (c.pushes_sent + 1) <= c.messages <= shards * (c.pushes_sent + 2)


@given(seed=st.integers(0, 10_000), shards=st.integers(1, 3))
@settings(max_examples=10, deadline=None)
def test_fused_one_replica_with_max_staleness_0_is_sequential_adagrad(seed: int, shards: int) -> None:
    model = models.Softmax(64, 10)
    w0 = model.init_params(seed)
    batches = plan_batches(160, 1, batch_size=16, epochs=1, seed=seed)
    sim = Simulator(
        model, X_SMALL, Y_SMALL, w0, batches, shards=shards, rule="adagrad", lr=0.2, seed=seed,
        max_staleness=0, fuse=True,
    )  # fmt: skip
    sim.run()
    ref = sequential_sgd(model, X_SMALL, Y_SMALL, w0, batches[0], rule="adagrad", lr=0.2)
    np.testing.assert_allclose(sim.x, ref.x, rtol=1e-10, atol=1e-12)
    assert sim.replicas[0].staleness == [0] * (len(batches[0]) * shards)
    assert sim.replicas[0].core.counters.messages <= shards * (len(batches[0]) + 2)


@given(
    seed=st.integers(0, 10_000),
    replicas=st.integers(1, 3),
    shards=st.integers(1, 3),
    fuse=st.booleans(),
    tau_exp=st.integers(-1, 3),
)
@settings(max_examples=12, deadline=None)
def test_compressed_pushes_land_once_and_the_residual_holds_the_rest(
    seed: int, replicas: int, shards: int, fuse: bool, tau_exp: int
) -> None:
    """Known gradients (c = 1..7, exact) pushed compressed and concurrently: the shards hold exactly the sum
    of what was sent, and sent + every residual is the sum of every gradient."""
    model = ConstantGradient(12)
    X, y = np.zeros((60, 1)), np.zeros(60)
    plans = plan_batches(60, replicas, batch_size=6, epochs=1, seed=seed)
    tau = 2.0**tau_exp
    sim = Simulator(
        model, X, y, np.zeros(12), plans, shards=shards, rule="sgd", lr=1.0, seed=seed, fuse=fuse,
        compression=Compression(tau=tau),
    )  # fmt: skip
    sim.run()
    steps = sum(len(p) for p in plans)
    residual = sum((_compressor(rep.core).residual for rep in sim.replicas), np.zeros(12))
    # lr = 1: the shards hold -(sum of +/-tau sent), exactly (dyadic values, no rounding).
    np.testing.assert_array_equal(-sim.x + residual, steps * model.c)
    # One quantum per entry per push at most (Strom: large gradients go out at rate tau, the rest waits).
    pushes = sum(rep.core.counters.pushes_sent for rep in sim.replicas)
    assert np.all(np.abs(sim.x) <= tau * pushes) and np.abs(sim.x).sum() > 0
    pushed = sum(rep.core.counters.bytes_pushed for rep in sim.replicas)
    sent_entries = np.abs(sim.x).sum() / tau
    assert pushed == 4 * sent_entries + 8 * shards * pushes


def test_a_fused_core_sends_one_message_per_shard_a_step() -> None:
    core = ReplicaCore([(0, 2), (2, 4)], rule="sgd", lr=0.1, fuse=True)
    model, X, y = ConstantGradient(4), np.zeros((1, 1)), np.zeros(1)
    core.begin_step()
    first = core.start_fetch()
    for i in range(2):
        core.on_fetched(first.fid, i, 0, [np.zeros(2)])
    for step in range(3):
        if step:
            core.begin_step()
            assert not core.fetch_wanted()  # the last push carried this step's fetch
        core.compute(model, X, y)
        msg = core.take_push()
        assert msg is not None and msg.fetch is not None
        for i in range(2):
            core.on_pushed(msg.seq, i, True, step + 1, 0, msg.gen)
            core.on_fetched(msg.fetch.fid, i, step + 1, [np.full(2, -0.1 * (step + 1))])
    assert core.counters.messages == 2 * 4 and core.counters.fused == 3
    np.testing.assert_allclose(core.x, [-0.3] * 4)
    # n_push != n_fetch: nothing to fuse.
    assert not ReplicaCore([(0, 2)], rule="sgd", lr=0.1, fuse=True, n_push=2).fuse


def test_compression_takes_over_key_value_pushes_and_keeps_fetching_keys() -> None:
    """Sparse communication and compression: fetches stay key-value; pushes are the sign-coded keys."""
    keys = [np.array([0, 2], np.int32), np.array([1], np.int32)]
    core = ReplicaCore(
        [(0, 3), (3, 6)], rule="sgd", lr=0.1, fetch_keys=keys, compression=Compression(tau=2.0), fuse=True
    )
    req = core.start_fetch()
    for i, k in enumerate(keys):
        core.on_fetched(req.fid, i, 0, [np.zeros(k.size)])
    model = ConstantGradient(6)  # c = [1, 2, 3, 4, 5, 6]
    core.compute(model, np.zeros((1, 1)), np.zeros(1))
    msg = core.take_push()
    assert msg is not None and msg.tau == 2.0 and msg.fetch is not None
    parts = msg.parts((0, 3, 6))
    decoded = []
    for _, codes in parts:
        assert codes is not None
        decoded.append(decode_signs(codes))
    assert [values for values, _ in parts] == [None, None]
    assert [k.tolist() for k, _ in decoded] == [[1, 2], [0, 1, 2]]  # |c| >= 2: global 1, 2, 3, 4, 5
    assert not any(neg.any() for _, neg in decoded)
    np.testing.assert_array_equal(_compressor(core).residual, [1, 0, 1, 2, 3, 4])
    assert core.counters.bytes_pushed == 4 * 5 + 8 * 2


def _compressor(core: ReplicaCore) -> ThresholdCompressor:
    """The compressor of a core made with ``compression=``."""
    assert core.compressor is not None
    return core.compressor
