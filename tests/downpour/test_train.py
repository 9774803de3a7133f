"""``downpour.train`` on the session's real LocalCluster (2 worker processes), against numpy references."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
from distributed import Client
from numpy.typing import ArrayLike, NDArray

from distbelief import downpour, models
from distbelief.downpour import BatchPlan, Progress, sequential_sgd
from distbelief.downpour._train import HISTORY_POINTS
from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.storage import Dataset, ParameterServer, train_test_split_digits
from tests.downpour import _helpers
from tests.downpour._helpers import ConstantGradient, global_batches

# The test model lives in this test package, which the workers cannot import: ship it by value.
cloudpickle.register_pickle_by_value(_helpers)

X_TR, Y_TR, X_TE, Y_TE = train_test_split_digits(seed=0)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    # Portions of 512 rows: a replica's rows span several portions (read portion by portion).
    path = tmp_path_factory.mktemp("downpour") / "digits"
    return Dataset.from_arrays(X_TR, Y_TR, path=path, portion_rows=512, label_kind="classes", n_classes=10)


def reference_batches(
    ds: Dataset, *, seed: int, steps: int, lo: int = 0, hi: int | None = None
) -> list[np.ndarray]:
    plan = BatchPlan.for_rows(ds, lo, ds.n_rows if hi is None else hi, batch_size=32, seed=seed, replica=0)
    return list(itertools.islice(global_batches(plan, 10_000), steps))


def test_one_replica_sgd_is_plain_sequential_minibatch_sgd(client: Client, digits: Dataset) -> None:
    model = models.MLP([64, 16, 10])
    res = downpour.train(
        model, digits, replicas=1, shards=2, rule="sgd", lr=0.1, l2=1e-3, max_steps=300, seed=3, trace=True,
        client=client,
    )  # fmt: skip
    ref = sequential_sgd(
        model, X_TR, Y_TR, model.init_params(3), reference_batches(digits, seed=3, steps=300), lr=0.1, l2=1e-3
    )
    assert res.stop_reason == "max_steps" and res.success and res.steps == 300
    np.testing.assert_allclose(res.losses[0], ref.losses, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-10, atol=1e-12)
    # The replica really ran ahead of its fetches (the exactness is not from lock-step).
    assert res.stats["staleness_mean"] > 0


def test_adagrad_on_the_shards_is_single_process_adagrad(client: Client, digits: Dataset) -> None:
    model = models.Softmax(64, 10)
    res = downpour.train(
        model, digits, replicas=1, shards=2, rule="adagrad", lr=0.3, max_steps=200, max_staleness=0,
        client=client,
    )  # fmt: skip
    ref = sequential_sgd(
        model, X_TR, Y_TR, model.init_params(0), reference_batches(digits, seed=0, steps=200), rule="adagrad",
        lr=0.3,
    )  # fmt: skip
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-10, atol=1e-12)
    assert np.nanmax(res.history.staleness_max.values) == 0
    assert res.history.stale_waits.values[-1] > 100  # it waited for a fresh fetch before nearly every step


def test_max_staleness_bounds_every_push_and_staleness_scale_is_applied(
    client: Client, digits: Dataset
) -> None:
    model = models.Softmax(64, 10)
    common = {"replicas": 1, "rule": "sgd", "max_steps": 300, "eval_every": 0.02, "client": client}
    # Unfused (the fused protocol's bound is checked in tests/downpour/test_compress.py): a free replica's
    # pushes are reliably staler than a bounded one's. Fused, a free replica's few coalesced pushes are
    # often fresher than a bounded replica's one push a step.
    free = downpour.train(model, digits, fuse=False, **common)  # type: ignore[arg-type]
    bounded = downpour.train(model, digits, max_staleness=1, fuse=False, **common)  # type: ignore[arg-type]
    assert np.nanmax(bounded.history.staleness_max.values) <= 1
    assert bounded.stats["stale_waits"] > 0 and free.stats["stale_waits"] == 0
    assert free.stats["staleness_mean"] > bounded.stats["staleness_mean"]


def test_fused_compressed_pushes_train_with_one_message_a_step_and_fewer_bytes(
    client: Client, digits: Dataset
) -> None:
    """Two replicas, two shards, Adagrad: every due push carries the next fetch, and compressed pushes
    (Strom, tau past the largest entry of a mini-batch gradient at the start) send a fraction of them."""
    model = models.Softmax(64, 10)
    common: dict[str, Any] = {
        "replicas": 2, "shards": 2, "rule": "adagrad", "lr": 0.3, "max_steps": 400, "eval_every": 0.05,
        "eval_data": (X_TE, Y_TE), "client": client,
    }  # fmt: skip
    plain = downpour.train(model, digits, fuse=False, **common)
    packed = downpour.train(model, digits, compression=downpour.Compression(tau=0.1), **common)
    for res in (plain, packed):
        assert res.success and res.history.messages.values[-1] == res.stats["messages"] > 0
    # Unfused: a message per shard for every push and every fetch; fused: a push and the next fetch are one
    # message (plus each replica's first fetch).
    assert plain.stats["fused_pushes"] == 0
    assert plain.stats["messages"] == plain.stats["pushes"] + plain.stats["fetches"]
    pushes = packed.stats["pushes"] // 2
    assert packed.stats["fused_pushes"] >= pushes - 2
    assert packed.stats["messages"] <= 2 * (pushes + 2)
    # Bytes a push: 8 a parameter uncompressed; 4 an entry sent (+8 for tau, per shard) compressed.
    per_push = packed.stats["bytes_pushed"] / pushes
    assert plain.stats["bytes_pushed"] / (plain.stats["pushes"] // 2) == 8 * model.n_params
    assert 16 < per_push < 0.5 * 8 * model.n_params
    assert packed.history.attrs["compression_tau"] == 0.1 and packed.history.attrs["fused"]
    # Both still learn (from ~0.1 at x0). How far in 400 asynchronous steps depends on the interleaving:
    # the compressed run measured 0.74-0.93 on a quiet box (0.78-0.93 before this session's changes too),
    # beside 0.92 uncompressed, so no closer comparison holds on every run.
    for res in (plain, packed):
        assert float(res.history.test_accuracy[-1]) > 0.5


@pytest.mark.parametrize("value", [0.05, "strom", downpour.Compression])
def test_bad_compression_is_refused_before_anything_is_stored(
    client: Client, tmp_path: Path, value: Any
) -> None:
    with pytest.raises(InvalidOptionError, match="compression"):
        downpour.train(models.Softmax(64, 10), (X_TR, Y_TR), max_steps=5, compression=value, client=client,
                       store=tmp_path)  # fmt: skip
    with pytest.raises(InvalidOptionError, match="fuse"):
        downpour.train(models.Softmax(64, 10), (X_TR, Y_TR), max_steps=5, fuse=1, client=client,  # type: ignore[arg-type]
                       store=tmp_path)  # fmt: skip
    with pytest.raises(InvalidOptionError, match="compression"):
        downpour.train(models.MLP([64, 8, 10]), (X_TR, Y_TR), max_steps=5, partitions=2, client=client,
                       compression=downpour.Compression(tau=0.1), store=tmp_path)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("rule", "scale"), [("sgd", False), ("sgd", True), ("adagrad", False)])
def test_concurrent_pushes_of_known_gradients_sum_exactly(
    client: Client, tmp_path: Path, rule: str, scale: bool
) -> None:
    """4 replicas push to 2 shards of 70,000 parameters (so each shard works on a thread of its own)."""
    n = 140_000
    model = ConstantGradient(n)
    data = (np.zeros((400, 1)), np.zeros(400))
    res = downpour.train(
        model, data, replicas=4, shards=2, rule=rule, lr=1e-3, batch_size=5, max_steps=400,  # type: ignore[arg-type]
        staleness_scale=scale, client=client, store=tmp_path,
    )  # fmt: skip
    per = res.stats["per_replica"]
    steps = res.steps
    assert sum(st["steps"] for st in per.values()) == steps >= 400
    assert res.stats["push_errors"] == res.stats["duplicates"] == 0
    if rule == "adagrad":
        # Each push's summed gradient went into the accumulators exactly once (a push of k steps: (k c)^2).
        ps = ParameterServer.open(client, store=res.store)
        try:
            acc = ps.gather("x.adagrad")
            np.testing.assert_array_equal(ps.gather("x"), res.x)
        finally:
            ps.close()
        for i, (lo, hi) in enumerate([(0, n // 2), (n // 2, n)]):
            k2 = sum(st["applied_steps_sq"][i] for st in per.values())
            np.testing.assert_allclose(acc[lo:hi], k2 * model.c[lo:hi] ** 2, rtol=1e-12)
        return
    weight = np.zeros(n)
    for i, (lo, hi) in enumerate([(0, n // 2), (n // 2, n)]):
        weight[lo:hi] = sum(st["applied_weight"][i] for st in per.values())
    if scale:
        assert res.stats["staleness_mean"] > 0 and weight.max() < steps
    else:
        np.testing.assert_array_equal(weight, steps)  # every step applied once on every shard
    np.testing.assert_allclose(res.x, -1e-3 * model.c * weight, rtol=1e-9)


@pytest.mark.parametrize(
    ("model", "lr", "max_staleness"),
    # Asynchronous runs differ from run to run: with lr=0.5 and 30 epochs the softmax ended below 0.93 in
    # about 1 run in 10 (0.90-0.92); with lr=0.3 and 40 epochs 16 runs of 16 ended at 0.939-0.955.
    # The MLP at lr=0.2 with max_staleness=32 once diverged in a full CI run (objective 0.18 -> 2.5, never
    # reproduced here: 18 of 18 runs fine beside two CPU hogs); lr=0.1 with max_staleness=8 ended at
    # 0.947-0.958 in 8 runs of 8 beside two hogs.
    [(models.Softmax(64, 10), 0.3, 32), (models.MLP([64, 32, 10], activation="tanh"), 0.1, 8)],
    ids=["softmax", "mlp"],
)
def test_digits_reach_093_held_out_accuracy_with_two_replicas(
    client: Client, digits: Dataset, model: models.Model, lr: float, max_staleness: int
) -> None:
    # Staleness bounded: at load ~10 the MLP run once stopped as diverged at step 669 of 40 epochs (a loss
    # back above its starting value). On a loaded box one replica can be starved of CPU while the other
    # runs hundreds of steps ahead, so its pushes come from parameters that old: the likeliest cause, and
    # what max_staleness bounds, whatever the load.
    res = downpour.train(
        model, digits, replicas=2, rule="adagrad", lr=lr, epochs=40, eval_data=(X_TE, Y_TE), eval_every=0.05,
        warmstart_steps=50, max_staleness=max_staleness, client=client,
    )  # fmt: skip
    assert res.success and res.stop_reason == "epochs", res.message
    assert res.history.test_accuracy.values[-1] >= 0.93
    assert model.accuracy(res.x, X_TE, Y_TE) == res.history.test_accuracy.values[-1]  # type: ignore[attr-defined]


def test_warm_start_lets_replica_0_train_alone_first(client: Client, digits: Dataset) -> None:
    # Alone, replica 0 is sequential SGD on its own rows: its first warm-start steps match the reference
    # exactly; then replica 1 joins and the trajectories part. (Staleness scaling, on by default for SGD with
    # 2 replicas, would scale replica 0's pushes by their staleness against its own: off here.)
    model = models.Softmax(64, 10)
    half = digits.n_rows // 2
    res = downpour.train(
        model, digits, replicas=2, rule="sgd", lr=0.1, warmstart_steps=150, max_steps=600, trace=True,
        staleness_scale=False, client=client,
    )  # fmt: skip
    ref = sequential_sgd(
        model, X_TR, Y_TR, model.init_params(0), reference_batches(digits, seed=0, steps=600, hi=half), lr=0.1
    )
    losses = res.losses[0]
    assert res.stats["per_replica"][1]["steps"] > 0
    np.testing.assert_allclose(losses[:150], ref.losses[:150], rtol=1e-10)
    # Replica 0's whole trajectory, not a prefix: on a loaded machine replica 1's first push may land only
    # after replica 0's step 400.
    assert len(losses) > 160 and not np.allclose(losses, ref.losses[: len(losses)], rtol=1e-10)


def test_history_holds_what_the_run_did(client: Client, digits: Dataset) -> None:
    seen: list[Progress] = []

    def callback(progress: Progress) -> None:
        seen.append(progress)
        if progress.step >= 4000:
            raise StopIteration

    res = downpour.train(
        models.Softmax(64, 10), digits, replicas=2, shards=2, time_limit=60, eval_data=(X_TE, Y_TE),
        eval_every=0.02, callback=callback, client=client,
    )  # fmt: skip
    h = res.history
    assert res.stop_reason == "callback" and res.success
    assert set(h.sizes) == {"time", "shard"} and h.sizes["shard"] == 2
    for name in (
        "step",
        "epoch",
        "train_loss",
        "test_loss",
        "test_accuracy",
        "staleness_mean",
        "staleness_max",
    ):
        assert h[name].dims == ("time",)
    for name in ("pushes", "fetches", "version"):
        assert h[name].dims == ("time", "shard")
    assert np.all(np.diff(h.time.values) > 0) and np.all(np.diff(h.step.values) >= 0)
    assert np.all(np.diff(h.pushes.values, axis=0) >= 0)
    assert h.step.values[0] == 0 and h.step.values[-1] == res.steps
    assert int(h.pushes.values[-1].sum()) == res.stats["pushes"]
    # Each push goes to both shards: they applied the same number of updates.
    assert h.pushes.values[-1, 0] == h.pushes.values[-1, 1] == h.version.values[-1, 0]
    np.testing.assert_allclose(h.epoch.values[-1] * digits.n_rows, res.steps * 32, rtol=0.05)
    assert np.isfinite(h.test_loss.values).all() and h.test_loss.values[-1] < h.test_loss.values[0]
    # The first rows may have no train loss yet (no replica had finished a step when they were taken).
    first_loss = h.train_loss.values[np.isfinite(h.train_loss.values)][0]
    assert np.nanmean(h.train_loss.values[-3:]) < first_loss
    assert len(seen) >= 5 and [p.step for p in seen] == list(h.step.values[1 : len(seen) + 1])
    # A row's staleness figures are over the same pushes: with pushes the maximum is at least the mean
    # (the dashboard showed staleness_mean 4 beside staleness_max 0 on a job's last row: issue 27).
    mean, most = h.staleness_mean.values, h.staleness_max.values
    assert np.array_equal(np.isnan(mean), np.isnan(most))
    pushed = np.isfinite(mean)
    assert pushed.sum() >= 5 and np.all(most[pushed] >= mean[pushed]), (mean, most)


def test_bad_input_is_refused_before_anything_runs(client: Client, digits: Dataset) -> None:
    model = models.Softmax(64, 10)
    with pytest.raises(InvalidOptionError, match="x0 has 3 values"):
        downpour.train(model, digits, max_steps=1, x0=np.zeros(3), client=client)
    with pytest.raises(InvalidOptionError, match="needs a way to stop"):
        downpour.train(model, digits, client=client)
    with pytest.raises(InvalidOptionError, match="data must be"):
        downpour.train(model, [X_TR, Y_TR], max_steps=1, client=client)  # type: ignore[arg-type]
    with pytest.raises(DatasetError, match="features"):
        downpour.train(model, digits, max_steps=1, eval_data=(X_TE[:, :3], Y_TE), client=client)
    with pytest.raises(DatasetError, match="features"):
        downpour.train(models.Softmax(3, 10), digits, max_steps=1, client=client)
    with pytest.raises(InvalidOptionError, match="at least one row"):
        downpour.train(model, (X_TR[:3], Y_TR[:3]), replicas=4, max_steps=1, client=client)


@pytest.mark.timeout(20)  # the shards of an unknown worker were waited for forever
@pytest.mark.parametrize("partitions", [1, 2], ids=["replicas", "partitions"])
@pytest.mark.parametrize("where", ["shard_workers", "replica_workers"])
def test_worker_addresses_not_in_the_cluster_are_refused(
    client: Client, digits: Dataset, tmp_path: Path, where: str, partitions: int
) -> None:
    model = models.MLP([64, 8, 10])
    run: dict[str, Any] = {"max_steps": 1, "partitions": partitions, "client": client, "store": tmp_path}
    string: dict[str, Any] = {where: "tcp://127.0.0.1:1"}  # a string, not a list
    with pytest.raises(InvalidOptionError, match=f"{where}=.*list of worker addresses"):
        downpour.train(model, digits, **run, **string)
    unknown: dict[str, Any] = {where: ["tcp://127.0.0.1:1"]}
    with pytest.raises(InvalidOptionError, match=r"'tcp://127\.0\.0\.1:1' is not a worker of the cluster"):
        downpour.train(model, digits, **run, **unknown, call_timeout=2.0)
    assert not (tmp_path / "params").exists() and not (tmp_path / "ps").exists()


class _SlowObjective(models.LeastSquares):
    """Least squares whose loss takes 0.08 s on more rows than a mini-batch: the driver's history objective
    (on every row) costs more than a poll's share of the evaluation budget, the replicas' steps do not."""

    def loss_and_grad(
        self, w: ArrayLike, X: ArrayLike, y: ArrayLike, *, sample_weight: ArrayLike | None = None
    ) -> tuple[float, NDArray[np.float64]]:
        if np.shape(X)[0] > 64:
            time.sleep(0.08)
        return super().loss_and_grad(w, X, y, sample_weight=sample_weight)


def test_an_expensive_objective_still_gives_the_callback_rows_as_the_run_goes(client: Client) -> None:
    # A row whose evaluation does not fit the 5% budget is made at once without its metrics, and the
    # budget goes to the newest row: a row whose measured cost is above one poll's share is evaluated once
    # the run's share covers it (the callback saw nothing until the end when a row had to fit a single
    # poll's 50 ms), and it is the latest one, not the oldest waiting (a 6 s run's callback got the rows of
    # steps 1 and 2, at 3.7 and 5.3 s). The end evaluates the rows skipped, as its budget allows.
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 3))
    seen: list[Progress] = []
    res = downpour.train(
        _SlowObjective(3), (X, X @ np.ones(3)), replicas=1, rule="sgd", lr=0.01, batch_size=8, time_limit=2.5,
        eval_every=0.05, callback=seen.append, client=client,
    )  # fmt: skip
    assert res.stop_reason == "time_limit"
    shown = [(round(p.time, 2), p.objective) for p in seen]
    during = [i for i, p in enumerate(seen) if 0 < p.time < res.wall_time and np.isfinite(p.objective)]
    assert during, shown
    # Rows came before the first evaluated one without their metrics: it was the newest ready row.
    assert any(np.isnan(p.objective) for p in seen[1 : during[0]]), shown
    filled = np.isfinite(res.history.objective.values).sum()
    assert filled > sum(np.isfinite(p.objective) for p in seen), (filled, shown)


@pytest.mark.parametrize("partitions", [1, 2], ids=["replicas", "partitions"])
def test_a_callback_that_is_not_callable_is_refused_before_anything_is_stored(
    client: Client, digits: Dataset, tmp_path: Path, partitions: int
) -> None:
    # It was a TypeError from the driver loop once the shards and replicas were running.
    with pytest.raises(InvalidOptionError, match="callback=5 is invalid"):
        downpour.train(
            models.MLP([64, 8, 10]), digits, max_steps=5, partitions=partitions, callback=5,  # type: ignore[arg-type]
            client=client, store=tmp_path,
        )  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_sparse_rows_train_as_their_dense_copy(client: Client, tmp_path: Path) -> None:
    import scipy.sparse as sp

    X = sp.csr_array(X_TR)  # digits are ~half zeros
    model = models.Softmax(64, 10)
    common: dict[str, Any] = {
        "replicas": 1, "shards": 2, "rule": "adagrad", "lr": 0.3, "max_steps": 150, "max_staleness": 0,
        "client": client, "seed": 4, "n_fetch": 1, "n_push": 1,  # the same steps both ways
    }  # fmt: skip
    sparse_ds = Dataset.from_arrays(
        X, Y_TR, path=tmp_path / "s", portion_rows=512, label_kind="classes", n_classes=10
    )
    dense_ds = Dataset.from_arrays(
        X_TR, Y_TR, path=tmp_path / "d", portion_rows=512, label_kind="classes", n_classes=10
    )
    sparse_run = downpour.train(model, sparse_ds, eval_data=(sp.csr_array(X_TE), Y_TE), **common)
    dense_run = downpour.train(model, dense_ds, eval_data=(X_TE, Y_TE), **common)
    batches = reference_batches(sparse_ds, seed=4, steps=150)
    ref = sequential_sgd(model, X, Y_TR, model.init_params(0), batches, rule="adagrad", lr=0.3)
    np.testing.assert_allclose(sparse_run.x, dense_run.x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sparse_run.x, ref.x, rtol=1e-10, atol=1e-12)
    # Evaluations happen on a clock (how many differs); the first (at x0) and the last (at x) do not.
    sparse_loss, dense_loss = sparse_run.history.test_loss.values, dense_run.history.test_loss.values
    np.testing.assert_allclose(sparse_loss[[0, -1]], dense_loss[[0, -1]], rtol=1e-10)


@pytest.mark.parametrize(
    "length",
    [{"max_steps": 10000, "replicas": 1}, {"epochs": 120, "replicas": 2}, {"time_limit": 2, "replicas": 2}],
)
def test_history_reports_the_training_objective_at_about_100_points_whatever_the_run_length(
    client: Client, digits: Dataset, length: dict[str, int | float]
) -> None:
    model, l2 = models.Softmax(64, 10), 1e-3
    res = downpour.train(model, digits, shards=2, l2=l2, client=client, **length)  # type: ignore[arg-type]
    h = res.history
    assert res.success and res.steps >= 100
    # The replicas record about HISTORY_POINTS entries and the driver evaluates them afterwards: no entry
    # costs a round trip. A run known only by its time limit plans by its measured step rate (a loaded host
    # delays steps in bursts): hence the margin there.
    assert len(h.time) >= (50 if "time_limit" in length else 90), (len(h.time), res.wall_time)
    assert len(h.time) <= 2 * HISTORY_POINTS * int(length["replicas"]) + 2
    # F(w) on the training rows at the shards' parameters, computed as Sandblaster computes it.
    assert h.attrs["objective_rows"] == digits.n_rows and h.attrs["l2"] == l2
    assert h.objective.values[0] == pytest.approx(
        models.objective(model, model.init_params(0), X_TR, Y_TR, l2=l2)[0]
    )
    assert h.objective.values[-1] == pytest.approx(
        models.objective(model, res.x, X_TR, Y_TR, l2=l2)[0], rel=1e-12
    )
    assert np.isfinite(h.objective.values).all() and h.objective.values[-1] < h.objective.values[0]
    assert h.train_loss.attrs["long_name"] == "running mini-batch loss"
    assert h.objective.attrs["long_name"] == "F(w) on the training data"


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_short_run_has_50_history_points_each_at_the_objective_of_its_recorded_parameters(
    client: Client, replicas: int
) -> None:
    # 300 steps of a two-feature logistic model: ~0.1-0.3 s, where one driver round trip per entry gave
    # 15 entries.
    rng = np.random.default_rng(3)
    X = rng.standard_normal((1000, 2))
    y = (rng.random(1000) < 1 / (1 + np.exp(-X @ np.array([1.5, -1.0])))).astype(float)
    l2 = 1e-2
    res = downpour.train(
        models.Logistic(2), (X, y), replicas=replicas, max_steps=300, l2=l2, trace=True, client=client
    )
    h = res.history
    assert res.success and len(h.time) >= 50, len(h.time)
    assert np.all(np.diff(h.time.values) > 0) and np.all(np.diff(h.step.values) >= 0)
    assert h.step.values[0] == 0 and h.step.values[-1] == res.steps
    # Every row carries its parameters (trace=True); the oracle: F(w) = mean log-loss + l2/2 ||w||^2.
    assert [t for t, _, _ in res.snapshots] == list(h.time.values)
    assert [s for _, s, _ in res.snapshots] == list(h.step.values)
    for (_, _, w), recorded in zip(res.snapshots, h.objective.values, strict=True):
        z = X @ w[:2] + w[2]
        expected = np.mean(np.logaddexp(0.0, z) - y * z) + l2 / 2 * (w @ w)
        assert recorded == pytest.approx(expected, rel=1e-12)
    assert len({float(v) for v in h.objective.values}) > 40  # distinct points, not one state repeated
    np.testing.assert_array_equal(res.snapshots[-1][2], res.x)


def test_a_wide_models_history_objective_is_computed_on_a_sample_its_cost_allows(
    client: Client, tmp_path: Path
) -> None:
    """Issue 30, item 3: the objective of a history row costs the model's work per row, not X's values.
    An MLP with ~400k parameters on 256 features gets ~250 of its rows (every row of a linear model of the
    same X would fit the values budget), so a run's rows cost milliseconds, not seconds each."""
    from distbelief.downpour._train import OBJECTIVE_MAX_WORK

    rng = np.random.default_rng(0)
    X = rng.normal(size=(4096, 256))
    y = (X[:, 0] > 0).astype(float)
    ds = Dataset.from_arrays(
        X, y, path=tmp_path / "wide", portion_rows=128, label_kind="classes", n_classes=2
    )
    mlp = models.MLP([256, 512, 512, 2], activation="tanh")
    res = downpour.train(mlp, ds, max_steps=20, batch_size=32, client=client)
    rows = res.history.attrs["objective_rows"]
    assert 128 <= rows < ds.n_rows
    assert rows * mlp.n_params <= 2 * OBJECTIVE_MAX_WORK  # whole portions: up to one more than the budget
    linear = downpour.train(models.Softmax(256, 2), ds, max_steps=20, batch_size=32, client=client)
    assert linear.history.attrs["objective_rows"] == ds.n_rows
