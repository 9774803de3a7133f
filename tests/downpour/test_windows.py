"""Windowed key-value replicas (``ReplicaCore.use_windows``): which keys each fetch asks for, when a step
waits, the local steps a late fetch must not lose, and the pushes, against hand-computed answers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import ArrayLike

from distbelief.downpour import ReplicaCore
from distbelief.errors import InvalidOptionError
from distbelief.storage import Shard

N = 40
RANGES = [(0, 16), (16, N)]


def _step_keys(step: int) -> np.ndarray:
    """Step ``step`` touches up to three keys, over both shards; steps ``2k`` and ``2k + 1`` share one."""
    return np.array(sorted({step // 2, (7 * step + 13) % N, (5 * step + 30) % N}))


def _union(start: int, end: int) -> np.ndarray:
    if end <= start:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate([_step_keys(t) for t in range(start, end)]))


def _core(n: int = 3, **kw: object) -> tuple[ReplicaCore, list[tuple[int, int]]]:
    asked: list[tuple[int, int]] = []

    def window_keys(start: int, end: int) -> np.ndarray:
        asked.append((start, end))
        return _union(start, end)

    core = ReplicaCore(RANGES, rule="sgd", lr=0.5, n_fetch=n, n_push=n, **kw)  # type: ignore[arg-type]
    core.use_windows(window_keys)
    return core, asked


def _shards() -> list[Shard]:
    shards = [Shard(i, lo, hi) for i, (lo, hi) in enumerate(RANGES)]
    for s in shards:
        s.set("x", s.lo, s.hi, np.arange(s.lo, s.hi) + 1.0)  # no zero: every step moves all its keys
    return shards


def _land(core: ReplicaCore, request: object, shards: list[Shard]) -> None:
    keys = request.keys  # type: ignore[attr-defined]
    for i, s in enumerate(shards):
        core.on_fetched(request.fid, i, s.applied, [s.gather("x", keys[i])])  # type: ignore[attr-defined]


def _step(core: ReplicaCore, step: int) -> None:
    keys = _step_keys(step)
    core.compute_at(_Identity(keys.size), keys, np.eye(keys.size), np.zeros(keys.size))


class _Identity:
    """A model whose mean gradient is ``w`` (loss ``|w|^2 / 2`` a row): every step's update is known."""

    def __init__(self, n: int) -> None:
        self.n_params = n

    def init_params(self, seed: int | None = None) -> np.ndarray:
        return np.zeros(self.n_params)

    def loss_and_grad(self, w: ArrayLike, X: Any, y: ArrayLike) -> tuple[float, np.ndarray]:
        x = np.asarray(w)
        return 0.5 * float(x @ x) * X.shape[0], x * X.shape[0]


def test_fetches_ask_for_the_next_window_and_a_step_waits_for_its_own() -> None:
    core, asked = _core(n=3)
    shards = _shards()
    first = core.start_fetch()
    assert asked == [(0, 6)]  # the first fetch: this window and the next
    assert [k.tolist() for k in first.keys] == [  # type: ignore[union-attr]
        [k for k in _union(0, 6).tolist() if k < 16],
        [k - 16 for k in _union(0, 6).tolist() if k >= 16],
    ]
    assert core.must_wait()  # nothing landed yet
    _land(core, first, shards)
    for step in range(3):
        core.begin_step()
        assert not core.must_wait()
        _step(core, step)
    msg = core.take_push()
    assert msg is not None and msg.fetch is None and msg.keys is not None  # not fused here
    # The push carries exactly the entries the window's steps moved, each shard's local offsets.
    moved = _union(0, 3)
    assert (
        np.concatenate([k + lo for k, (lo, _) in zip(msg.keys, RANGES, strict=True)]).tolist()
        == moved.tolist()
    )
    core.begin_step()  # step 3: the fetch due asks for the window after this one
    assert core.fetch_wanted()
    second = core.start_fetch()
    assert asked[-2:] == [(0, 3), (6, 9)]  # the push's keys (its window), then the fetch's
    assert not core.must_wait()  # step 3 was covered by the first fetch
    for step in range(3, 6):
        if step > 3:
            core.begin_step()
        _step(core, step)
    core.take_push()
    core.begin_step()
    assert core.must_wait()  # step 6's keys come with the second fetch, not landed yet
    _land(core, second, shards)
    assert not core.must_wait()


def test_a_fetch_that_lands_late_keeps_the_local_steps_taken_since_it_was_sent() -> None:
    core, _ = _core(n=1, max_staleness=0)  # each fetch covers the current step too: step 0's keys
    shards = _shards()
    _land(core, core.start_fetch(), shards)
    core.begin_step()
    late = core.start_fetch()
    keys = _step_keys(0)
    before = core.x[keys].copy()
    _step(core, 0)  # the local step moves x[keys] by -0.5 * x[keys]
    np.testing.assert_array_equal(core.x[keys], before + -0.5 * before)
    core.x[keys] = np.nan  # whatever the local copy holds, a landing fetch rebuilds it
    _land(core, late, shards)  # the shards have not seen the step: fetched + own step
    np.testing.assert_array_equal(core.x[keys], (np.arange(N) + 1.0)[keys] + -0.5 * before)


def test_a_late_fetch_keeps_unsent_steps_and_those_taken_around_a_push_sent_meanwhile() -> None:
    # A fetch's answer lacks every local step the shards have not applied: those not yet pushed when it was
    # issued, and all taken since. A push sent while it is in flight clears the unsent steps it carries (the
    # fetch then holds its own copy): the answer must still get all of them, not only those since the push.
    core, _ = _core(n=1, max_staleness=0)
    shards = _shards()
    _land(core, core.start_fetch(), shards)
    moved = np.zeros(N)

    def step(t: int) -> None:
        before = core.x.copy()
        _step(core, t)
        moved[:] += core.x - before

    core.begin_step()
    step(0)  # not pushed when the next fetch is issued
    late = core.start_fetch()  # covers steps 1 and 2
    step(1)
    msg = core.take_push(force=True)
    assert msg is not None and msg.keys is not None  # carries steps 0 and 1: the shards never apply it here
    step(2)
    keys = np.concatenate([k + lo for k, (lo, _) in zip(late.keys, RANGES, strict=True)])  # type: ignore[arg-type]
    core.x[keys] = np.nan  # whatever the local copy holds, a landing fetch rebuilds it
    _land(core, late, shards)
    np.testing.assert_allclose(core.x[keys], (np.arange(N) + 1.0)[keys] + moved[keys], rtol=1e-15, atol=0)
    assert np.isin(_union(0, 3), keys).sum() > len(_step_keys(2))  # steps 0-2 moved some of its keys


@pytest.mark.parametrize("intercept", [True, False])
def test_a_linear_models_step_added_from_its_rows_equals_the_narrowed_step(intercept: bool) -> None:
    # accrue_rows (the residuals of a step's rows, added nonzero by nonzero) against compute_at on the rows
    # narrowed to their columns (the path every other model takes), on two cores fed the same fetches; a
    # fetch issued before a push and landing after it gets every local step too.
    import scipy.sparse as sp

    from distbelief.models import Logistic
    from distbelief.storage.internal import compact_batch, sparse_layout_of

    d = N - 1 if intercept else N
    model = Logistic(d, fit_intercept=intercept)
    rng = np.random.default_rng(5)
    X = sp.random_array((24, d), density=0.2, random_state=rng, format="csr")
    y = (rng.random(24) < 0.5).astype(np.float64)
    table = np.full(d, -1, dtype=np.int32)
    layout = sparse_layout_of(model)
    assert layout is not None
    cores = []
    for _ in range(2):
        core = ReplicaCore(RANGES, rule="sgd", lr=0.5, n_fetch=2, n_push=2)
        core.use_windows(lambda a, b: np.arange(N) if b > a else np.zeros(0, dtype=np.int64))
        cores.append(core)
    shards = _shards()
    late = []
    for t, rows in enumerate(np.array_split(rng.permutation(24), 6)):
        rows = np.sort(rows).astype(np.int64)
        for i, core in enumerate(cores):
            if t == 0:
                _land(core, core.start_fetch(), shards)
            if t == 2:
                late.append(core.start_fetch())
            if i == 0:
                got = model.rows_residuals(core.x, X, y, rows)
                assert got is not None
                core.accrue_rows(X, rows, got[1], got[0], intercept=d if intercept else None)
            else:
                part = compact_batch(layout, X, y, rows, table).for_model(model)
                core.compute_at(part.model, part.keys, part.X, part.y)
            if t == 3:
                assert core.take_push(force=True) is not None  # while the late fetch is in flight
    for core, request in zip(cores, late, strict=True):
        _land(core, request, shards)
    a, b = cores
    np.testing.assert_allclose(a.x, b.x, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(a.accrued, b.accrued, rtol=1e-13, atol=1e-15)
    assert np.abs(a.accrued).max() > 0.01 and a.counters.steps == b.counters.steps == 6
    assert a.counters.rows == 24 and a.counters.loss_sum == pytest.approx(b.counters.loss_sum, rel=1e-14)


def test_a_failed_fetch_is_asked_for_again_and_its_steps_wait() -> None:
    core, asked = _core(n=2)
    shards = _shards()
    _land(core, core.start_fetch(), shards)  # covers steps 0-3
    for step in range(2):
        core.begin_step()
        _step(core, step)
    core.take_push()
    core.begin_step()
    failing = core.start_fetch()  # steps 4-5
    core.on_fetch_failed(failing.fid, 0)
    core.on_fetch_failed(failing.fid, 1)
    for step in range(2, 4):
        if step > 2:
            core.begin_step()
        assert not core.must_wait()
        _step(core, step)
    core.take_push()
    core.begin_step()
    assert core.must_wait() and core.fetch_wanted()
    retry = core.start_fetch()
    assert asked[-1] == (4, 8)  # from the gap the failure left, to the end of the next window
    _land(core, retry, shards)
    assert not core.must_wait()


def test_a_staleness_bound_asks_for_the_current_step_too() -> None:
    core, asked = _core(n=2, max_staleness=0)
    _land(core, core.start_fetch(), _shards())
    core.begin_step()
    _step(core, 0)
    core.begin_step()
    _step(core, 1)
    core.take_push()
    core.begin_step()
    core.start_fetch()
    assert asked[-1] == (2, 6)  # not (4, 6): the step after the push reads what this fetch brings


def test_windows_refuse_what_they_cannot_serve() -> None:
    with pytest.raises(InvalidOptionError, match="l2 = 0"):
        ReplicaCore(RANGES, rule="sgd", lr=0.1, l2=0.1).use_windows(_union)
    with pytest.raises(InvalidOptionError, match="deterministic"):
        ReplicaCore(RANGES, rule="sgd", lr=0.1, deterministic=True).use_windows(_union)
    core, _ = _core()
    with pytest.raises(InvalidOptionError, match="compute_at"):
        core.apply(np.ones(N))
