"""The replica logic and the references with no Dask: ReplicaCore against in-process shards, any timing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief import models
from distbelief.downpour import BatchPlan, DownpourOptions, ReplicaCore, sequential_sgd, split_rows
from distbelief.errors import InvalidOptionError
from distbelief.storage import train_test_split_digits
from tests.downpour._helpers import ConstantGradient, Simulator, global_batches, plan_batches

X_TR, Y_TR, _, _ = train_test_split_digits(seed=0)
X_SMALL, Y_SMALL = X_TR[:240], Y_TR[:240]


# -- batches ---------------------------------------------------------------------------------------------
@given(
    n_rows=st.integers(1, 500),
    parts=st.integers(1, 8),
    portion=st.integers(1, 200),
    batch=st.integers(1, 64),
    seed=st.integers(0, 5),
)
@settings(max_examples=60, deadline=None)
def test_every_row_is_visited_once_per_epoch(
    n_rows: int, parts: int, portion: int, batch: int, seed: int
) -> None:
    if parts > n_rows:
        with pytest.raises(InvalidOptionError, match="at least one row"):
            split_rows(n_rows, parts)
        return
    ranges = split_rows(n_rows, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == n_rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    seen = []

    class FakeDataset:
        portion_rows = portion

    for r, (lo, hi) in enumerate(ranges):
        plan = BatchPlan.for_rows(FakeDataset(), lo, hi, batch_size=batch, seed=seed, replica=r)
        # Segments never cross a portion boundary (a replica reads portion by portion).
        assert all(a // portion == (b - 1) // portion for a, b in plan.segments)
        for e in range(2):
            rows = np.concatenate(list(global_batches(plan, e + 1))[plan.batches_per_epoch * e :])
            assert sorted(rows.tolist()) == list(range(lo, hi))
            assert all(len(b) <= batch for b in global_batches(plan, 1))
        seen += list(range(lo, hi))
    assert seen == list(range(n_rows))


def test_shuffles_differ_by_epoch_and_replica_but_repeat_with_the_seed() -> None:
    plan = BatchPlan(((0, 100),), batch_size=100, seed=1, replica=0)
    again = BatchPlan(((0, 100),), batch_size=100, seed=1, replica=0)
    other = BatchPlan(((0, 100),), batch_size=100, seed=1, replica=1)
    e0, e1 = (next(iter(plan.epoch(e)))[1] for e in (0, 1))
    assert not np.array_equal(e0, e1)
    assert np.array_equal(e0, next(iter(again.epoch(0)))[1])
    assert not np.array_equal(e0, next(iter(other.epoch(0)))[1])


# -- references --------------------------------------------------------------------------------------------
def test_sequential_sgd_full_batch_converges_to_least_squares_solution() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=50)
    model = models.LeastSquares(3, fit_intercept=False)
    res = sequential_sgd(model, X, y, np.zeros(3), [np.arange(50)] * 2000, lr=0.3)
    np.testing.assert_allclose(res.x, np.linalg.lstsq(X, y, rcond=None)[0], rtol=1e-8)
    assert res.steps == 2000 and res.stop_reason == "batches"


def test_sequential_adagrad_matches_a_hand_written_loop() -> None:
    model = models.Softmax(64, 10)
    w0 = model.init_params(1)
    batches = plan_batches(240, 1, batch_size=16, epochs=2, seed=0)[0]
    res = sequential_sgd(model, X_SMALL, Y_SMALL, w0, batches, rule="adagrad", lr=0.2, l2=1e-2)
    w, acc = w0.copy(), np.zeros_like(w0)
    for rows in batches:
        _, g = model.loss_and_grad(w, X_SMALL[rows], Y_SMALL[rows])
        g = g / len(rows) + 1e-2 * w
        acc += g * g
        w -= 0.2 * g / (np.sqrt(acc) + 1e-8)
    np.testing.assert_allclose(res.x, w, rtol=1e-12, atol=1e-14)


# -- the replica core against in-process shards, for any interleaving --------------------------------------
@given(seed=st.integers(0, 10_000), shards=st.integers(1, 3), n_fetch=st.integers(1, 3))
@settings(max_examples=25, deadline=None)
def test_one_replica_sgd_is_sequential_sgd_whatever_the_timing(seed: int, shards: int, n_fetch: int) -> None:
    model = models.Softmax(64, 10)
    w0 = model.init_params(seed)
    batches = plan_batches(240, 1, batch_size=16, epochs=2, seed=seed)
    sim = Simulator(
        model, X_SMALL, Y_SMALL, w0, batches, shards=shards, rule="sgd", lr=0.1, seed=seed, l2=1e-3,
        n_fetch=n_fetch, trace=True,
    )  # fmt: skip
    sim.run()
    ref = sequential_sgd(model, X_SMALL, Y_SMALL, w0, batches[0], rule="sgd", lr=0.1, l2=1e-3)
    np.testing.assert_allclose(sim.replicas[0].core.losses, ref.losses, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sim.x, ref.x, rtol=1e-10, atol=1e-12)


@given(seed=st.integers(0, 10_000), shards=st.integers(1, 3), local=st.sampled_from([None, 0.0, 0.5]))
@settings(max_examples=20, deadline=None)
def test_one_replica_with_max_staleness_0_is_sequential_adagrad(
    seed: int, shards: int, local: float | None
) -> None:
    model = models.Softmax(64, 10)
    w0 = model.init_params(seed)
    batches = plan_batches(240, 1, batch_size=16, epochs=2, seed=seed)
    sim = Simulator(
        model, X_SMALL, Y_SMALL, w0, batches, shards=shards, rule="adagrad", lr=0.2, seed=seed,
        max_staleness=0, local_lr=local,
    )  # fmt: skip
    sim.run()
    ref = sequential_sgd(model, X_SMALL, Y_SMALL, w0, batches[0], rule="adagrad", lr=0.2)
    np.testing.assert_allclose(sim.x, ref.x, rtol=1e-10, atol=1e-12)
    assert sim.replicas[0].staleness == [0] * (len(batches[0]) * shards)


@given(seed=st.integers(0, 10_000), bound=st.integers(0, 3))
@settings(max_examples=25, deadline=None)
def test_max_staleness_bounds_every_push_of_a_lone_replica(seed: int, bound: int) -> None:
    model = models.Softmax(64, 10)
    batches = plan_batches(240, 1, batch_size=8, epochs=1, seed=seed)
    sim = Simulator(
        model, X_SMALL, Y_SMALL, model.init_params(0), batches, shards=2, rule="sgd", lr=0.1, seed=seed,
        max_staleness=bound,
    )  # fmt: skip
    sim.run()
    assert sim.replicas[0].staleness and max(sim.replicas[0].staleness) <= bound


def test_without_a_bound_the_same_schedules_do_get_stale() -> None:
    # The check above is not vacuous: the simulator's delays do produce stale pushes.
    model = models.Softmax(64, 10)
    worst = 0
    for seed in range(5):
        batches = plan_batches(240, 1, batch_size=8, epochs=1, seed=seed)
        sim = Simulator(
            model, X_SMALL, Y_SMALL, model.init_params(0), batches, shards=2, rule="sgd", lr=0.1, seed=seed
        )
        sim.run()
        worst = max(worst, *sim.replicas[0].staleness)
    assert worst > 3


@given(
    seed=st.integers(0, 10_000),
    replicas=st.integers(1, 4),
    shards=st.integers(1, 3),
    n_push=st.integers(1, 3),
    scale=st.booleans(),
)
@settings(max_examples=30, deadline=None)
def test_every_step_lands_once_with_the_weight_the_shards_report(
    seed: int, replicas: int, shards: int, n_push: int, scale: bool
) -> None:
    """Known gradients pushed concurrently: the shards' vector is the exact (staleness-weighted) sum."""
    model = ConstantGradient(12)
    X, y = np.zeros((200, 1)), np.zeros(200)
    plans = plan_batches(200, replicas, batch_size=7, epochs=2, seed=seed)
    sim = Simulator(
        model, X, y, np.zeros(12), plans, shards=shards, rule="sgd", lr=0.01, seed=seed, n_push=n_push,
        staleness_scale=scale,
    )  # fmt: skip
    sim.run()
    steps = sum(len(p) for p in plans)
    weights = np.zeros(12)
    for rep, plan in zip(sim.replicas, plans, strict=True):
        assert rep.core.counters.steps == len(plan)
        assert not rep.core._fetches and not rep.core._pending  # nothing in flight
        for i, (lo, hi) in enumerate(sim.layout.ranges()):
            weights[lo:hi] += rep.core.counters.applied_weight[i]
    if not scale:
        assert np.all(weights == steps)
    np.testing.assert_allclose(sim.x, -0.01 * model.c * weights, rtol=1e-12)


@given(seed=st.integers(0, 10_000), replicas=st.integers(1, 3), n_push=st.integers(1, 4))
@settings(max_examples=25, deadline=None)
def test_adagrad_accumulators_take_each_push_as_one_gradient(seed: int, replicas: int, n_push: int) -> None:
    """As in the paper with n_push > 1: a push of k steps' summed gradient adds (k c)^2, exactly once."""
    model = ConstantGradient(10)
    X, y = np.zeros((120, 1)), np.zeros(120)
    plans = plan_batches(120, replicas, batch_size=4, epochs=1, seed=seed)
    sim = Simulator(
        model, X, y, np.zeros(10), plans, shards=2, rule="adagrad", lr=0.01, seed=seed, n_push=n_push
    )
    sim.run()
    for i, (lo, hi) in enumerate(sim.layout.ranges()):
        k2 = sum(rep.core.counters.applied_steps_sq[i] for rep in sim.replicas)
        np.testing.assert_allclose(sim.shards[i].get("x.adagrad"), k2 * model.c[lo:hi] ** 2, rtol=1e-12)
        if n_push > 1:
            assert k2 > sum(len(p) for p in plans)  # pushes did group steps


def test_push_coalesces_while_too_many_are_in_flight_and_a_reset_forgets_versions() -> None:
    core = ReplicaCore([(0, 2), (2, 4)], rule="sgd", lr=0.1, max_pushes_in_flight=1)
    req = core.start_fetch()
    for i, (lo, hi) in enumerate(core.ranges):
        core.on_fetched(req.fid, i, 5, [np.zeros(hi - lo)])
    assert core.ready and core.base == [5, 5]
    model = ConstantGradient(4)
    X, y = np.zeros((1, 1)), np.zeros(1)
    core.compute(model, X, y)
    first = core.take_push()
    assert first is not None and first.steps == 1 and first.fetched_versions == (5, 5)
    core.compute(model, X, y)
    assert core.take_push() is None  # one push in flight: the gradient keeps accruing
    core.compute(model, X, y)
    core.on_pushed(first.seq, 0, True, 6, 0, first.gen)
    core.on_pushed(first.seq, 1, True, 9, 3, first.gen)
    second = core.take_push()
    assert second is not None and second.steps == 2
    np.testing.assert_array_equal(second.grad, 2 * model.c)
    assert core.staleness_estimate() == 9 + 1 - 5
    core.reset_shards()
    assert core.fetch_wanted() and core.staleness_estimate() == 0
    late = core.start_fetch()
    core.on_fetched(req.fid, 0, 100, [np.ones(2)])  # an abandoned fetch's answer changes nothing
    assert core.base == [5, 5]
    core.on_fetched(late.fid, 1, 2, [np.zeros(2)])
    assert core.base == [5, 2] and core.known[1] == 2  # the restored shard's lower version is believed


def test_a_non_finite_gradient_is_not_applied() -> None:
    core = ReplicaCore([(0, 3)], rule="sgd", lr=0.1)
    req = core.start_fetch()
    core.on_fetched(req.fid, 0, 0, [np.full(3, 1e300)])
    model = models.LeastSquares(2)
    with np.errstate(all="ignore"):
        core.compute(model, np.array([[1e10, 0.0]]), np.array([1.0]))
    assert core.diverged and core.accrued_steps == 0 and np.all(core.x == 1e300)


# -- options -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rule": "rmsprop"}, "rule"),
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"local_lr": -1.0}, "local_lr"),
        ({"batch_size": 0}, "batch_size"),
        ({"n_fetch": 1.5}, "n_fetch"),
        ({"n_push": True}, "n_push"),
        ({"replicas": 0}, "replicas"),
        ({"shards": -1}, "shards"),
        ({"warmstart_steps": -1}, "warmstart_steps"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"time_limit": 0}, "time_limit"),
        ({"eval_every": 0}, "eval_every"),
        ({"checkpoint_every_s": -1}, "checkpoint_every_s"),
        ({"l2": -0.1}, "l2"),
        ({"seed": -1}, "seed"),
        ({"staleness_scale": 1}, "staleness_scale"),
        ({"replica_workers": ()}, "replica_workers"),
        ({"max_coalesce": -1}, "max_coalesce"),
        ({"max_coalesce": 2.5}, "max_coalesce"),
        ({"max_coalesce": True}, "max_coalesce"),
    ],
)
def test_bad_options_are_refused_with_a_message_naming_them(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        DownpourOptions(max_steps=10, **kwargs)  # type: ignore[arg-type]


def test_a_run_needs_a_way_to_stop() -> None:
    with pytest.raises(InvalidOptionError, match="needs a way to stop"):
        DownpourOptions()
    assert DownpourOptions(has_callback=True).lr == 0.2


def test_a_push_backlog_past_max_coalesce_makes_the_next_step_wait() -> None:
    core = ReplicaCore([(0, 2)], rule="adagrad", lr=0.1, max_coalesce=2, max_pushes_in_flight=1)
    core.on_fetched(core.start_fetch().fid, 0, 0, [np.zeros(2)])
    model = models.LeastSquares(1)
    X, y = np.ones((1, 1)), np.ones(1)
    core.compute(model, X, y)
    assert core.take_push() is not None  # one push in flight: the next ones accrue
    for _ in range(2):
        assert not core.push_backlogged()
        core.compute(model, X, y)
        assert core.take_push() is None
    assert core.push_backlogged() and core.accrued_steps == 2
    core.on_pushed(0, 0, True, 1, 0, 0)  # answered: the two accrued steps go out as one push
    assert not core.push_backlogged() and core.take_push().steps == 2  # type: ignore[union-attr]
