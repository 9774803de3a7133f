"""Reproducible Sandblaster runs (issue 18, item 6): the same job gives bit-identical iterates whatever the
replica timing, stealing, backup copies, calls in flight, a lost replica or a restart from a checkpoint.

Every assertion is ``==`` on float64 bits, not a tolerance. Each portion's gradient and loss are the same
bits wherever they are computed; the shards sum gradients binned (``storage._exactsum``: independent of
which replica summed which portions and of arrival order), the scheduler sums losses with ``math.fsum``,
and the coordinator reduces shard partials with ``math.fsum``. With arrival-order float sums these runs
differ in the last bits after the first evaluation, and L-BFGS amplifies that over the iterations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client, LocalCluster

from distbelief import sandblaster
from distbelief.sandblaster._minimize import SandblasterOptions, _run
from distbelief.storage import Dataset, start_vector
from tests.sandblaster.conftest import Problem
from tests.sandblaster.test_minimize import _kill_worker, dataset

#: The history columns that are the run's iterates (the rest are timings and counters).
ITERATES = ("objective", "grad_norm", "step", "nfev")


def _run_with(
    problem: Problem, ds: Dataset, client: Client, store: Path, callback: Any = None, **options: Any
) -> sandblaster.OptimizeResult:
    """:func:`sandblaster.minimize` with every option of :class:`SandblasterOptions` (``in_flight`` too)."""
    options.setdefault("portions", ds.n_portions)  # the dataset's portions (default: ~10 ms of work each)
    opts = SandblasterOptions(l2=problem.l2, **options)
    x0 = start_vector(problem.model, problem.x0, 0)
    result: sandblaster.OptimizeResult = _run(problem.model, ds, x0, client, str(store), opts, callback)
    return result


def assert_same_run(a: sandblaster.OptimizeResult, b: sandblaster.OptimizeResult) -> None:
    """The same iterates, bit for bit."""
    assert a.nit == b.nit and a.nfev == b.nfev
    assert a.fun == b.fun
    assert np.array_equal(a.x, b.x), f"x differs in {int((a.x != b.x).sum())} of {a.x.size} entries"
    for name in ITERATES:
        assert np.array_equal(a.history[name].values, b.history[name].values), name


@pytest.fixture
def problem(softmax_digits: Problem) -> Problem:
    return softmax_digits


def test_timing_backups_and_calls_in_flight_change_no_bit(
    client: Client, tmp_path: Path, problem: Problem
) -> None:
    ds = dataset(problem, tmp_path / "data", 96)  # 19 portions: groups of several per push
    common = {"maxiter": 12, "push_every": 3}
    plain = _run_with(problem, ds, client, tmp_path / "plain", **common)
    # A 50x straggler: the other replica steals its queue and backs up its portions (first result wins).
    slow = _run_with(problem, ds, client, tmp_path / "slow", slowdown={0: 50.0}, **common)
    # No backups, one call in flight, the other replica slow, a push per portion.
    other = _run_with(
        problem, ds, client, tmp_path / "other", slowdown={1: 3.0}, backups=False, in_flight=1,
        maxiter=12, push_every=1,
    )  # fmt: skip
    assert int(slow.history.backups_issued.sum()) > 0
    assert slow.stats["portions_per_replica"] != plain.stats["portions_per_replica"]
    assert plain.nit == 12
    assert_same_run(slow, plain)
    assert_same_run(other, plain)


def test_a_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(
    client: Client, tmp_path: Path, problem: Problem
) -> None:
    ds = dataset(problem, tmp_path / "data", 256)
    full = _run_with(problem, ds, client, tmp_path / "full", maxiter=14)
    first = _run_with(problem, ds, client, tmp_path / "run", maxiter=6, checkpoint_every=3)
    assert first.nit == 6
    resumed = _run_with(
        problem, ds, client, tmp_path / "run", maxiter=14, checkpoint_every=3, resume=True, slowdown={0: 3.0}
    )
    assert_same_run(resumed, full)


def test_a_run_that_loses_a_replica_equals_the_uninterrupted_run(
    three_workers: tuple[LocalCluster, Client, list[str]],
    tmp_path: Path,
    problem: Problem,
) -> None:
    cluster, client, workers = three_workers
    ds = dataset(problem, tmp_path / "data", 128)
    common = {
        "maxiter": 10, "portions": 8, "shard_workers": (workers[0],), "replica_workers": tuple(workers[1:])
    }  # fmt: skip
    whole = _run_with(problem, ds, client, tmp_path / "whole", **common)

    def kill_replica_1(record: sandblaster.IterationRecord) -> None:
        if record.iteration == 3:
            _kill_worker(cluster, workers[2])

    hurt = _run_with(problem, ds, client, tmp_path / "hurt", callback=kill_replica_1, **common)
    assert hurt.stats["lost_replicas"] == [1]
    assert_same_run(hurt, whole)


def test_a_float32_history_is_reproducible_through_stragglers_budgets_and_resumes(
    client: Client, tmp_path: Path, logistic_digits: Problem
) -> None:
    """Issue 29, item 3: the history stored as float32 changes no promise of this module."""
    problem = logistic_digits
    ds = dataset(problem, tmp_path / "data", 256)
    plain = _run_with(problem, ds, client, tmp_path / "plain", maxiter=8, history_dtype="float32")
    assert plain.stats["history_dtype"] == "float32" and plain.nit == 8
    # "auto" under a budget that cannot hold a float64 history (28 vectors of 65 values) picks float32,
    # with a 5x straggler whose portions the other replica steals and backs up.
    tight = _run_with(
        problem, ds, client, tmp_path / "tight", maxiter=8, shard_memory=65 * 8 * 20, slowdown={0: 5.0}
    )
    assert tight.stats["history_dtype"] == "float32"
    assert_same_run(tight, plain)
    first = _run_with(
        problem, ds, client, tmp_path / "run", maxiter=4, checkpoint_every=2, history_dtype="float32"
    )
    assert first.nit == 4
    resumed = _run_with(problem, ds, client, tmp_path / "run", maxiter=8, checkpoint_every=2, resume=True)
    assert resumed.stats["history_dtype"] == "float32"  # "auto" resumes in the checkpoint's dtype
    assert_same_run(resumed, plain)
