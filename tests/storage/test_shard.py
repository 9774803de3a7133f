"""The pure shard against numpy as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.errors import InvalidOptionError, ProtocolError
from distbelief.storage import Shard, _exactsum, adagrad_update, sgd_update


def make(size: int, seed: int = 0) -> tuple[Shard, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shard = Shard(0, 10, 10 + size)
    ref = {name: rng.standard_normal(size) for name in "abc"}
    for name, values in ref.items():
        shard.set(name, 10, 10 + size, values)
    return shard, ref


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 300), alpha=st.floats(-5, 5), beta=st.floats(-5, 5), seed=st.integers(0, 99))
def test_ops_match_numpy(size: int, alpha: float, beta: float, seed: int) -> None:
    shard, ref = make(size, seed)
    a, b, c = ref["a"], ref["b"], ref["c"]
    out = shard.run(
        [
            ("axpy", alpha, "a", "b"),
            ("dot", "a", "b"),
            ("lincomb", "d", [alpha, beta, 1.0], ["a", "b", "c"]),
            ("lincomb", "c", [beta, alpha], ["c", "a"]),
            ("scale", beta, "a"),
            ("dots", [("a", "d"), ("c", "c")]),
            ("norm2", "d"),
            ("norm_inf", "d"),
            ("copy", "d", "e"),
            ("mul", "a", "e", "f"),
            ("fill", "g", 3.0),
            ("sum", "g"),
        ]
    )
    b2 = b + alpha * a
    d = alpha * a + beta * b2 + c
    c2 = beta * c + alpha * a
    a2 = beta * a
    assert out[0] is None
    np.testing.assert_allclose(out[1], a @ b2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(shard.get("b"), b2, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(shard.get("d"), d, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(shard.get("c"), c2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out[5], [a2 @ d, c2 @ c2], rtol=1e-12, atol=1e-11)
    np.testing.assert_allclose(out[6], d @ d, rtol=1e-12, atol=1e-12)
    assert out[7] == np.max(np.abs(shard.get("d")))
    assert out[7] == pytest.approx(np.max(np.abs(d)), rel=1e-12)
    np.testing.assert_array_equal(shard.get("e"), shard.get("d"))
    np.testing.assert_array_equal(shard.get("f"), shard.get("a") * shard.get("e"))
    assert out[11] == 3.0 * size


def test_get_and_set_use_global_indices() -> None:
    shard, ref = make(8)
    np.testing.assert_array_equal(shard.get("a", 12, 15), ref["a"][2:5])
    np.testing.assert_array_equal(shard.get("a", 0, 100), ref["a"])
    shard.set("a", 12, 14, np.array([7.0, 8.0]))
    assert list(shard.get("a", 12, 14)) == [7.0, 8.0]
    with pytest.raises(InvalidOptionError, match="owns"):
        shard.set("a", 5, 12, np.zeros(7))


def test_unknown_vector_and_op_are_refused_with_advice() -> None:
    shard, _ = make(3)
    with pytest.raises(InvalidOptionError, match="no vector 'zz'"):
        shard.run([("dot", "a", "zz")])
    with pytest.raises(ProtocolError, match="unknown shard op"):
        shard.run([("explode", "a")])


def test_a_lincomb_stores_its_destination_as_float32_and_refuses_other_dtypes() -> None:
    shard, ref = make(5)
    shard.run([("lincomb", "s0", [1.0, -1.0], ["a", "b"], "float32")])
    s0 = (ref["a"] - ref["b"]).astype(np.float32)
    np.testing.assert_array_equal(shard.get("s0"), s0)
    # Its dot products accumulate in float64 (float32's would be ~1e-7 off).
    (ss, sa), up = shard.run([("dots", [("s0", "s0"), ("s0", "a")])])[0], s0.astype(np.float64)
    assert ss == pytest.approx(float(up @ up), rel=1e-14) and sa == pytest.approx(
        float(up @ ref["a"]), rel=1e-14
    )
    assert shard.state()["dtypes"] == {"s0": "float32"} and shard.narrow_dtypes(["a", "s0"]) == {
        "s0": "float32"
    }
    # Written again as float64: a float64 vector again.
    shard.run([("lincomb", "s0", [2.0], ["a"], "float64")])
    assert shard.get("s0").dtype == np.float64 and "dtypes" not in shard.state()
    assert not shard.vectors.holds_narrow
    before = {name: shard.get(name) for name in shard.vectors}
    with pytest.raises(InvalidOptionError, match="no vector 'zz'"):  # b is not made anew as float32 first
        shard.run([("lincomb", "b", [1.0, 2.0], ["a", "zz"], "float32")])
    for bad in ("float16", "double", "", 32):
        for dst in ("y0", "a", "b"):  # a new vector, a term, an existing vector
            with pytest.raises(InvalidOptionError, match="'float64' or 'float32'"):
                shard.run([("lincomb", dst, [1.0, 2.0], ["a", "c"], bad)])
    shard.run([("lincomb", "c", [1.0], ["b"], "float32")])
    with pytest.raises(InvalidOptionError, match="is one of the terms and stored as float32"):
        shard.run([("lincomb", "c", [0.5, 1.0], ["c", "a"], "float64")])
    before["c"] = ref["b"].astype(np.float32)
    assert sorted(shard.vectors) == sorted(before)  # nothing created by the refused ops
    for name, values in before.items():
        np.testing.assert_array_equal(shard.get(name), values)


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_push_applies_rule_once_per_token(rule: str) -> None:
    shard, ref = make(5)
    g = np.arange(5.0) - 2
    expected = ref["a"].copy()
    acc = np.zeros(5)
    for seq in range(3):
        applied, version, _ = shard.push(g, source="r0", seq=seq, rule=rule, lr=0.1, param="a")
        assert applied and version == seq + 1
        if rule == "sgd":
            sgd_update(expected, g, lr=0.1)
        else:
            adagrad_update(expected, g, acc, lr=0.1)
        # The same token again is a retry: nothing changes.
        applied, version, _ = shard.push(g, source="r0", seq=seq, rule=rule, lr=0.1, param="a")
        assert not applied and version == seq + 1
        np.testing.assert_allclose(shard.get("a"), expected, rtol=1e-14)


def test_adagrad_matches_the_paper_formula() -> None:
    w, acc = np.zeros(3), np.zeros(3)
    grads = [np.array([1.0, -2.0, 0.5]), np.array([3.0, 1.0, -0.5])]
    for g in grads:
        adagrad_update(w, g, acc, lr=0.5)
    sq = grads[0] ** 2
    w_ref = -0.5 * grads[0] / np.sqrt(sq)
    sq = sq + grads[1] ** 2
    w_ref = w_ref - 0.5 * grads[1] / np.sqrt(sq)
    np.testing.assert_allclose(w, w_ref, rtol=1e-7)


def test_push_reports_staleness_and_can_scale_by_it() -> None:
    shard, _ = make(2)
    g = np.ones(2)
    for seq in range(3):
        shard.push(g, source="a", seq=seq, rule="sgd", lr=1.0, param="a", fetched_version=0)
    before = shard.get("a")
    applied, version, staleness = shard.push(
        g, source="b", seq=0, rule="sgd", lr=1.0, param="a", fetched_version=1, staleness_scale=True
    )
    assert applied and version == 4 and staleness == 2
    np.testing.assert_allclose(shard.get("a"), before - 1.0 / 3.0)


def test_staleness_scaling_leaves_out_the_pushers_own_updates() -> None:
    # A replica's own earlier pushes are in the local copy its gradient came from: they are not staleness.
    shard, _ = make(2)
    g = np.ones(2)
    common = {"rule": "sgd", "lr": 1.0, "param": "a", "fetched_version": 0, "staleness_scale": True}
    steps = []
    for source, seq in [("a", 0), ("a", 1), ("b", 0), ("a", 2)]:
        before = shard.get("a").copy()
        _, _, staleness = shard.push(g, source=source, seq=seq, **common)  # type: ignore[arg-type]
        steps.append((staleness, float((before - shard.get("a"))[0])))
    # Reported: every update since version 0. Scaled by: the other source's updates only.
    assert [s for s, _ in steps] == [0, 1, 2, 3]
    np.testing.assert_allclose([d for _, d in steps], [1.0, 1.0, 1.0 / 3.0, 0.5], rtol=1e-14)
    assert shard.counters()["applied_weight"] == pytest.approx(1 + 1 + 1 / 3 + 1 / 2)


def test_a_restored_or_rolled_back_shard_scales_staleness_as_at_its_checkpoint() -> None:
    # others_since needs which updates were the pusher's own: a checkpoint keeps that with the version, so a
    # shard restored from it (a new one, or this one rolled back) leaves out the same updates as before.
    import json

    shard, _ = make(2)
    g = np.ones(2)
    push = {"rule": "sgd", "lr": 1.0, "param": "a"}
    for source, seq in [("a", 0), ("b", 0), ("a", 1)]:
        shard.push(g, source=source, seq=seq, **push)  # type: ignore[arg-type]
    state = json.loads(json.dumps(shard.state()))  # as the server stores it (the store's JSON attributes)
    expected = [(src, v, shard.others_since(src, v)) for src in "abc" for v in range(4)]
    assert expected[:4] == [("a", 0, 1), ("a", 1, 1), ("a", 2, 0), ("a", 3, 0)]
    # Rolled back after "a" pushed on: its later pushes must not count as its own at the versions reused.
    for seq in (2, 3):
        shard.push(g, source="a", seq=seq, **push)  # type: ignore[arg-type]
    shard.load_state(state)
    fresh, _ = make(2)
    fresh.load_state(state)
    for restored in (shard, fresh):
        assert [(src, v, restored.others_since(src, v)) for src, v, _ in expected] == expected
    # And from there on: "b" pushes twice, then "a" (fetched at 3) is scaled by those two updates.
    for seq in (1, 2):
        shard.push(g, source="b", seq=seq, **push)  # type: ignore[arg-type]
    assert shard.others_since("a", 3) == 2 and shard.others_since("b", 3) == 0


def test_summed_and_solo_pushes_count_each_portion_exactly_once() -> None:
    shard = Shard(0, 0, 4)
    shard.reset_accumulator("acc", epoch=1)
    g = {p: np.full(4, float(p + 1)) for p in range(6)}
    assert shard.accumulate("acc", g[0] + g[1], [0, 1], epoch=1)
    assert not shard.accumulate("acc", g[0] + g[1], [0, 1], epoch=1)  # a retried push
    assert not shard.accumulate("acc", g[1], [1], epoch=1, solo=True)  # a backup copy, already summed
    assert shard.accumulate("acc", g[2], [2], epoch=1, solo=True)  # a backup copy that arrived first ...
    assert shard.accumulate("acc", g[2] + g[3], [2, 3], epoch=1)  # ... then the summed push: counted once
    assert shard.accumulate("acc", g[4], [4], epoch=1, solo=True)  # a recomputation nobody else pushed
    assert not shard.accumulate("acc", g[4], [4], epoch=1, solo=True)
    assert not shard.accumulate("acc", g[5], [5], epoch=0)  # a straggler from an earlier evaluation
    assert shard.settle("acc") == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(shard.get("acc"), g[0] + g[1] + g[2] + g[3] + g[4])
    with pytest.raises(ProtocolError, match="overlaps"):
        shard.accumulate("acc", g[3] + g[5], [3, 5], epoch=1)
    with pytest.raises(ProtocolError, match="one portion"):
        shard.accumulate("acc", g[5], [5, 6], epoch=1, solo=True)
    shard.reset_accumulator("acc", epoch=2)
    assert shard.settle("acc") == []
    np.testing.assert_array_equal(shard.get("acc"), np.zeros(4))
    with pytest.raises(InvalidOptionError, match="summed exactly"):
        shard.reset_accumulator("acc", epoch=3, expected=_exactsum.MAX_TERMS + 1)


@settings(max_examples=50, deadline=None)
@given(
    n_portions=st.integers(1, 12),
    seed=st.integers(0, 10_000),
)
def test_any_order_of_pushes_and_copies_sums_every_portion_once(n_portions: int, seed: int) -> None:
    """Random splits into summed pushes plus random solo copies, in random order: the sum is exact."""
    rng = np.random.default_rng(seed)
    # Of very different magnitudes, so that a float sum's bits depend on its order and grouping.
    grads = rng.standard_normal((n_portions, 5)) * 10.0 ** rng.integers(-8, 8, (n_portions, 1))
    order = rng.permutation(n_portions)
    cuts = sorted(rng.choice(np.arange(1, n_portions), size=min(2, n_portions - 1), replace=False))
    groups = [list(map(int, g)) for g in np.split(order, cuts) if len(g)]
    pushes: list[tuple[list[int], bool]] = [(grp, False) for grp in groups]
    pushes += [([int(p)], True) for p in rng.choice(n_portions, size=n_portions, replace=True)]
    rng.shuffle(pushes)
    shard = Shard(0, 0, 5)
    shard.reset_accumulator("acc", epoch=7)
    for portions, solo in pushes:
        push = grads[portions[0]]
        if len(portions) > 1:  # several portions travel as their binned sum, as a replica pushes them
            push = _exactsum.zeros(5)
            for p in portions:
                _exactsum.deposit(push, grads[p])
        shard.accumulate("acc", push, portions, epoch=7, solo=solo)
    assert shard.settle("acc") == list(range(n_portions))
    reference = _exactsum.zeros(5)
    for grad in grads:  # in portion order, one at a time
        _exactsum.deposit(reference, grad)
    assert np.array_equal(shard.get("acc"), _exactsum.value(reference))  # the same bits, whatever the order


@pytest.mark.parametrize("keys", [[2, -1], [1, 1], [3, 0], [0, 4]])
def test_key_value_pushes_with_bad_keys_are_refused_and_change_nothing(keys: list[int]) -> None:
    # Keys must be sorted, unique local offsets: a -1 after a 2 would update the last entry, a repeated key
    # would lose one of its updates.
    s = Shard(0, 10, 14)
    s.set("x", 10, 14, np.arange(4.0))
    s.run([("reset_acc", "g", 1, 2, [])])
    k = np.array(keys)
    with pytest.raises(InvalidOptionError, match="sorted, unique"):
        s.push(np.ones(2), source="r", seq=0, rule="sgd", lr=1.0, keys=k)
    with pytest.raises(InvalidOptionError, match="sorted, unique"):
        s.push_parts("g", [(k, np.ones(2))], [0], epoch=1)
    np.testing.assert_array_equal(s.get("x"), np.arange(4.0))
    assert s.version == 0 and s.accumulators["g"].covered == set()


def test_adagrad_on_a_spilled_shard_gives_the_in_ram_bits() -> None:
    # The accumulator made by the first push went to a spill file while that push updated a RAM copy.
    shards = [Shard(0, 0, 4), Shard(0, 0, 4, memory_budget=0)]
    for s in shards:
        s.set("x", 0, 4, np.zeros(4))
        for seq in range(3):
            s.push(np.arange(1.0, 5.0) * (seq + 1), source="r", seq=seq, rule="adagrad", lr=0.1)
    assert shards[1].vectors.spilled == {"x", "x.adagrad"}
    for name in ("x", "x.adagrad"):
        np.testing.assert_array_equal(shards[1].get(name), shards[0].get(name))
    np.testing.assert_array_equal(shards[0].get("x.adagrad"), [14.0, 56.0, 126.0, 224.0])
    shards[1].close()
