"""``downpour.train(..., partitions=K)``: replicas split into partition actors, shards aligned to them."""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from distributed import Client

from distbelief import downpour, models
from distbelief.downpour import BatchPlan, sequential_sgd
from distbelief.downpour._reference import ReferenceResult
from distbelief.errors import ClusterError, DatasetError, InvalidOptionError
from distbelief.storage import Dataset, train_test_split_digits, worker_addresses
from tests.downpour._helpers import global_batches

X_TR, Y_TR, _, _ = train_test_split_digits(seed=0)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    path = tmp_path_factory.mktemp("downpour-mp") / "digits"
    return Dataset.from_arrays(X_TR, Y_TR, path=path, portion_rows=512, label_kind="classes", n_classes=10)


def _reference(
    model: models.MLP | models.LocallyConnected, ds: Dataset, steps: int, **kw: Any
) -> ReferenceResult:
    plan = BatchPlan.for_rows(ds, 0, ds.n_rows, batch_size=32, seed=3, replica=0)
    batches = list(itertools.islice(global_batches(plan, 100), steps))
    return sequential_sgd(model, X_TR, Y_TR, model.init_params(3), batches, **kw)


@pytest.mark.parametrize(
    "model",
    [
        models.LocallyConnected(64, 10, fields=[6, 3], strides=[2, 1]),
        models.MLP([64, 12, 10], activation="tanh"),
    ],
    ids=["locally_connected", "mlp"],
)
def test_two_partitions_one_replica_is_sequential_sgd(
    client: Client, digits: Dataset, model: models.MLP | models.LocallyConnected
) -> None:
    res = downpour.train(
        model, digits, replicas=1, partitions=2, rule="sgd", lr=0.1, l2=1e-3, max_steps=40, seed=3,
        max_staleness=0, trace=True, client=client,
    )  # fmt: skip
    ref = _reference(model, digits, 40, lr=0.1, l2=1e-3)
    assert res.steps == 40 and res.stats["partitions"] == 2 and res.stop_reason == "max_steps"
    np.testing.assert_allclose(res.losses[0], ref.losses, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-10, atol=1e-12)
    # Each partition pushed only to its own shard: one shard per partition, one push per step each.
    assert res.stats["shards"] == 2 and res.stats["pushes"] == 2 * 40
    assert res.stats["messages_per_step"] > 0 and res.stats["bytes_per_step"] > 0


def test_fetching_and_pushing_every_few_steps_is_sequential_sgd(client: Client, digits: Dataset) -> None:
    # One replica, rule="sgd", local_lr = lr: the local steps between fetches and pushes are the shards'
    # updates taken early, so the run is sequential SGD whatever n_fetch and n_push (paper, Algorithm 7.1).
    model = models.LocallyConnected(64, 10, fields=[6], strides=[2])
    res = downpour.train(
        model, digits, replicas=1, partitions=2, rule="sgd", lr=0.1, l2=1e-3, max_steps=40, seed=3,
        n_fetch=2, n_push=3, trace=True, client=client,
    )  # fmt: skip
    ref = _reference(model, digits, 40, lr=0.1, l2=1e-3)
    np.testing.assert_allclose(res.losses[0], ref.losses, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-10, atol=1e-12)
    # Each partition pushed to its one shard after steps 3, 6, ..., 39, and once more for step 40.
    assert res.stats["pushes"] == 2 * (40 // 3 + 1)


#: The history variables of every Downpour run, whole replicas or partitioned.
HISTORY = {"step", "epoch", "train_loss", "objective", "test_loss", "test_accuracy", "staleness_mean",
           "staleness_max", "replicas_alive", "push_errors", "stale_waits", "bytes_moved", "messages",
           "pushes", "fetches", "version", "applied"}  # fmt: skip


def test_partitioned_adagrad_with_two_replicas_learns(client: Client, digits: Dataset) -> None:
    model = models.LocallyConnected(64, 10, fields=[6], strides=[2])
    res = downpour.train(
        model, digits, replicas=2, partitions=2, epochs=2, lr=0.3, client=client, eval_data=(X_TR, Y_TR)
    )
    assert res.steps == 2 * 2 * 23 and res.stop_reason == "epochs"  # 2 replicas x 2 epochs x ceil(719 / 32)
    assert model.accuracy(res.x, X_TR, Y_TR) > 0.8
    # The whole replicas' history (one driver makes both): its last row at the shards' final parameters.
    h = res.history
    assert set(h.data_vars) == HISTORY and h.attrs["partitions"] == 2 and h.sizes["time"] >= 2
    assert int(h.step[-1]) == res.steps and float(h.epoch[-1]) == 2.0 and int(h.replicas_alive[-1]) == 2
    f_end = models.objective(model, res.x, X_TR, Y_TR)[0]
    assert float(h.objective[-1]) == pytest.approx(f_end, rel=1e-12) and f_end < float(h.objective[0])
    assert float(h.test_accuracy[-1]) == pytest.approx(model.accuracy(res.x, X_TR, Y_TR))
    assert int(h.pushes[-1].sum()) == res.stats["pushes"] == 2 * res.steps  # a push per step per partition


def test_unsupported_options_are_refused(client: Client, digits: Dataset, tmp_path: Any) -> None:
    model = models.MLP([64, 10])
    with pytest.raises(InvalidOptionError, match="warmstart_steps=3 is not supported with partitions=2"):
        downpour.train(model, digits, partitions=2, warmstart_steps=3, max_steps=1, client=client)
    with pytest.raises(InvalidOptionError, match="n_push"):
        downpour.train(model, digits, partitions=2, n_push=0, max_steps=1, client=client)
    bads: tuple[Any, ...] = (-1.0, math.inf, "5", True)
    for bad in bads:
        with pytest.raises(InvalidOptionError, match=r"checkpoint_every_s=.* is invalid"):
            downpour.train(model, digits, partitions=2, checkpoint_every_s=bad, max_steps=1, client=client)
    with pytest.raises(InvalidOptionError, match="cannot be partitioned"):
        downpour.train(models.Softmax(64, 10), digits, partitions=2, max_steps=1, client=client)
    # Refused before the arrays are written to the store.
    with pytest.raises(InvalidOptionError, match="cannot be partitioned"):
        downpour.train(models.Softmax(64, 10), (X_TR, Y_TR), partitions=2, max_steps=1, client=client,
                       store=tmp_path)  # fmt: skip
    assert not any(tmp_path.iterdir())


def _actors_here(dask_worker: Any) -> list[str]:
    return [str(key) for key in dask_worker.state.actors]


def _steps_here(before: list[str], dask_worker: Any = None) -> int:
    """The most steps a partition actor on this worker, not one of ``before``, has taken."""
    actors = dask_worker.state.actors
    return max((int(getattr(a, "steps", 0)) for k, a in actors.items() if str(k) not in before), default=0)


def _killer(
    client: Client, address: str, at_steps: int, killed: list[int], settle_s: float = 0.0
) -> threading.Thread:
    """A thread that SIGKILLs the worker at ``address`` once a partition of this run there took ``at_steps``
    steps, and ``settle_s`` seconds more (time for a checkpoint holding those steps' pushes)."""
    # Actors of earlier tests may linger on the worker: only this run's partitions count.
    before = client.run(_actors_here, workers=[address])[address]

    def kill_once_training() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            steps = client.run(_steps_here, before, workers=[address]).get(address, 0)
            if steps >= at_steps:
                time.sleep(settle_s)
                pid = client.run(os.getpid, workers=[address])[address]
                os.kill(pid, signal.SIGKILL)
                killed.append(steps)
                return
            time.sleep(0.02)

    return threading.Thread(target=kill_once_training)


def test_a_killed_partition_worker_is_rebuilt_and_the_shards_count_every_applied_push(
    client: Client, digits: Dataset
) -> None:
    home, other = worker_addresses(client)
    killed: list[int] = []
    # Partition 0 of both replicas and every shard on one worker, partition 1 of both on the other.
    model = models.LocallyConnected(64, 10, fields=[6], strides=[2])
    thread = _killer(client, other, 10, killed)
    thread.start()
    res = downpour.train(
        model, digits, replicas=2, partitions=2, rule="sgd", lr=0.05, max_steps=200, client=client,
        shard_workers=[home], replica_workers=[home, other], call_timeout=20.0,
    )  # fmt: skip
    thread.join()
    assert killed, "the run ended before the kill"
    assert res.success and res.steps == 200
    assert sorted(res.stats["rebuilt_replicas"]) == [0, 1]
    per = res.stats["per_partition"]
    shard0, shard1 = res.stats["shard_counters"]
    # Partition 0 survived (and was stopped, then replaced): every push its generations saw applied is on
    # its shard, and nothing else is.
    assert shard0["applied"] == sum(p["applied"] for p in per if p["partition"] == 0)
    # Partition 1's first generation died with its worker: its shard also holds the pushes it made before.
    after = sum(p["applied"] for p in per if p["partition"] == 1)
    stopped_at = sum(p["steps"] for p in per if p["partition"] == 0 and p["stopped"])
    assert after < shard1["applied"] <= after + stopped_at
    assert np.isfinite(res.x).all() and model.accuracy(res.x, X_TR, Y_TR) > 0.5


def test_a_killed_worker_holding_a_shard_and_partitions_is_recovered_from_the_checkpoint(
    client: Client, digits: Dataset
) -> None:
    # Shard k and partition k of both replicas on worker k: killing worker 1 loses shard 1 with them.
    home, other = worker_addresses(client)
    killed: list[int] = []
    model = models.LocallyConnected(64, 10, fields=[6], strides=[2])
    # The kill waits 0.3 s past step 60, six checkpoint intervals: a checkpoint then holds pushes (killed
    # at once, a fast run had only its empty first checkpoint, and the test could not tell the two apart).
    thread = _killer(client, other, 60, killed, settle_s=0.3)
    thread.start()
    res = downpour.train(
        model, digits, replicas=2, partitions=2, rule="sgd", lr=0.05, max_steps=400, client=client,
        shard_workers=[home, other], replica_workers=[home, other], call_timeout=20.0,
        checkpoint_every_s=0.05,
    )  # fmt: skip
    thread.join()
    assert killed, "the run ended before the kill"
    assert res.success and res.steps == 400
    assert res.stats["recoveries"] >= 1 and res.stats["checkpoints"] >= 2
    assert [shard for _, shard in res.stats["shard_losses"]] == [1]
    assert sorted(res.stats["rebuilt_replicas"]) == [0, 1]
    per = res.stats["per_partition"]
    shard0, shard1 = res.stats["shard_counters"]
    # Shard 0 was not lost: every push partition 0's generations saw applied is on it, and nothing else.
    assert shard0["applied"] == sum(p["applied"] for p in per if p["partition"] == 0)
    # Shard 1 came back from a checkpoint taken after some pushes (its counters with it; a shard restored
    # empty would hold only the pushes after the kill), and holds no more than the replicas had pushed
    # before the kill, plus what the rebuilt partitions saw applied.
    after = sum(p["applied"] for p in per if p["partition"] == 1)
    stopped_at = sum(p["steps"] for p in per if p["partition"] == 0 and p["stopped"])
    assert after < shard1["applied"] <= after + stopped_at
    assert np.isfinite(res.x).all() and model.accuracy(res.x, X_TR, Y_TR) > 0.5


def test_a_callback_sees_the_progress_and_can_stop_the_run(client: Client, digits: Dataset) -> None:
    model = models.LocallyConnected(64, 10, fields=[6], strides=[2])
    seen: list[downpour.Progress] = []
    on_event_loop: list[bool] = []

    def stop_after_a_few(progress: downpour.Progress) -> None:
        seen.append(progress)
        # The user's code (the service's writes its metrics to the store) must not block the Dask client's
        # event loop, which every actor call of every run in the process goes through.
        try:
            asyncio.get_running_loop()
            on_event_loop.append(True)
        except RuntimeError:
            on_event_loop.append(False)
        if progress.step >= 10:
            raise StopIteration

    res = downpour.train(
        model, digits, replicas=2, partitions=2, rule="sgd", lr=0.05, max_steps=100_000, client=client,
        callback=stop_after_a_few,
    )  # fmt: skip
    # (The message may carry the shared stall warning: downpour._watch.)
    assert res.success and res.stop_reason == "callback" and res.message.startswith("stopped by the callback")
    assert seen[-1].step >= 10 and 10 <= res.steps < 100_000
    assert [p.step for p in seen] == sorted(p.step for p in seen) and seen[-1].replicas_alive == 2
    assert any(np.isfinite(p.train_loss) for p in seen)
    assert on_event_loop and not any(on_event_loop)
    # Every push the partitions saw applied is on the shards: the stop lost none.
    per = res.stats["per_partition"]
    for k, shard in enumerate(res.stats["shard_counters"]):
        assert shard["applied"] == sum(p["applied"] for p in per if p["partition"] == k) > 0


def test_a_second_run_on_the_same_store_starts_over(client: Client, digits: Dataset, tmp_path: Any) -> None:
    # The service runs a job in the same run directory again when a restart interrupted it before its end
    # (a partitioned job starts over): the shards the first run left in the store must not stop it.
    model = models.MLP([64, 8, 10])
    first = downpour.train(model, digits, partitions=2, max_steps=2, store=tmp_path, client=client)
    again = downpour.train(model, digits, partitions=2, max_steps=2, store=tmp_path, client=client)
    assert first.success and again.success and again.steps == 2


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"lr": -1.0}, "lr=-1.0 is invalid"),
        ({"lr": math.nan}, "lr=nan is invalid"),
        ({"l2": -1.0}, "l2=-1.0 is invalid"),
        ({"seed": -1}, "seed=-1 is invalid"),
        ({"max_steps": 0}, "max_steps=0 is invalid"),
        ({"epochs": 0, "max_steps": None}, "epochs=0 is invalid"),
        ({"call_timeout": 0.0}, "call_timeout=0.0 is invalid"),
        ({"shuffle": "yes"}, "shuffle='yes' is invalid"),
        ({"trace": 1}, "trace=1 is invalid"),
        ({"partitions": True}, "partitions=True is invalid: expected None or an int >= 1"),
        # Options a partitioned run would otherwise ignore without a word.
        ({"resume": True}, "holds no Downpour checkpoint"),  # resume needs one in the store
        ({"poll_every": 0.5}, "poll_every=0.5 is not supported with partitions=2"),
        ({"fuse": False}, "fuse=False is not supported with partitions=2"),
        ({"communication": "sparse"}, "communication='sparse' is not supported with partitions=2"),
    ],
)
def test_bad_or_ignored_options_are_refused_before_the_run(
    client: Client, digits: Dataset, tmp_path: Any, option: dict[str, Any], match: str
) -> None:
    kwargs: dict[str, Any] = {"partitions": 2, "max_steps": 1, "client": client, "store": tmp_path, **option}
    with pytest.raises(InvalidOptionError, match=match):
        downpour.train(models.MLP([64, 8, 10]), digits, **kwargs)
    assert not any(tmp_path.iterdir())  # nothing was stored


def test_a_partitioned_run_whose_parameters_blow_up_is_not_a_success(client: Client, digits: Dataset) -> None:
    # It reported success=True with inf / NaN parameters (the service then called the job "succeeded").
    model = models.MLP([64, 8, 10], activation="relu")
    res = downpour.train(model, digits, partitions=2, rule="sgd", lr=1e300, max_steps=20, client=client)
    assert not np.isfinite(res.x).all()
    assert not res.success and res.stop_reason == "diverged" and "lower lr" in res.message


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (models.MLP([10, 8, 10]), "features"),  # the digits have 64: it trained on the first 10
        (models.MLP([64, 8, 3]), "label"),  # labels 0..9 for 3 classes
    ],
    ids=["features", "labels"],
)
def test_data_the_model_cannot_train_on_is_refused(
    client: Client, digits: Dataset, model: models.MLP, match: str
) -> None:
    with pytest.raises(DatasetError, match=match):
        downpour.train(model, digits, partitions=2, max_steps=2, client=client)


def test_a_failed_partition_says_why(client: Client, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # "a partition of replica 0 failed (its worker is alive)" said nothing of the error the partition raised.
    from distbelief.downpour import _partitioned
    from distbelief.storage.internal import confirm_dead_async

    # The worker is alive: no need to watch it for the 10 s grace a lost worker gets to be reported.
    monkeypatch.setattr(_partitioned, "confirm_dead_async", functools.partial(confirm_dead_async, grace=0.3))
    ds = Dataset.from_arrays(X_TR, Y_TR, path=tmp_path / "d", label_kind="classes", n_classes=10)
    for chunk in (tmp_path / "d" / "X").rglob("*"):  # the rows are gone: every read of them fails
        if chunk.is_file() and chunk.name != "zarr.json":
            chunk.write_bytes(b"not a chunk")
    with pytest.raises(ClusterError, match=r"a partition of replica 0 failed \(its worker is alive\): \w+"):
        downpour.train(models.MLP([64, 8, 10]), ds, partitions=2, max_steps=2, client=client)


def test_a_stopped_partitioned_run_resumes_from_its_checkpoint_as_if_never_stopped(
    client: Client, digits: Dataset, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One replica: sequential Adagrad (as sequential SGD above), so the stopped run and the resumed one
    # together must be the uninterrupted run: parameters, Adagrad accumulators and counts all restored.
    from distbelief.downpour import _partitioned
    from distbelief.downpour._resume import checkpoint_vector, resume_point

    # The callback comes early, and the run is long enough for its stop to land: on a quiet box 80 steps
    # took 0.24 s, which the first call (with its objective) outlasted, and the run ended before the stop.
    monkeypatch.setattr(_partitioned, "PROGRESS_EVERY", 0.01)
    n = 400

    model = models.LocallyConnected(64, 10, fields=[6], strides=[2])
    opts: dict[str, Any] = dict(replicas=1, partitions=2, rule="adagrad", lr=0.1, l2=1e-3, max_steps=n,
                                seed=3, client=client, store=tmp_path, trace=True)  # fmt: skip
    seen: list[downpour.Progress] = []

    def stop_at_once(progress: downpour.Progress) -> None:
        seen.append(progress)
        if progress.step >= 1:
            raise StopIteration

    first = downpour.train(model, digits, **opts, callback=stop_at_once)
    assert first.stop_reason == "callback" and 1 <= first.steps < n
    point = resume_point(tmp_path)
    assert point is not None and point.final and point.step == first.steps
    x0 = model.init_params(3)
    # The checkpoint holds the stopped run's parameters (partition-major on the shards), not x0.
    np.testing.assert_array_equal(np.sort(checkpoint_vector(tmp_path)), np.sort(first.x))
    assert np.linalg.norm(first.x - x0) > 0
    # Its history rows carry the objective (F(x0) on the first, at the shards' parameters on the last; a
    # row the run's evaluation budget did not cover reached the callback with NaN metrics).
    assert seen
    f = first.history.objective.values
    assert f[0] == pytest.approx(models.objective(model, x0, X_TR, Y_TR, l2=1e-3)[0])
    assert f[-1] == pytest.approx(models.objective(model, first.x, X_TR, Y_TR, l2=1e-3)[0]) and f[-1] < f[0]

    # Resuming needs the run's store, a checkpoint in it, and the run's partitions and replicas.
    with pytest.raises(InvalidOptionError, match="needs the store"):
        downpour.train(model, digits, **{**opts, "store": None}, resume=True)
    with pytest.raises(InvalidOptionError, match="holds no Downpour checkpoint"):
        downpour.train(model, digits, **{**opts, "store": tmp_path / "empty"}, resume=True)
    with pytest.raises(InvalidOptionError, match="with partitions=2 and"):
        downpour.train(model, digits, **{**opts, "partitions": 3}, resume=True)
    with pytest.raises(InvalidOptionError, match="resume it with replicas=1"):
        downpour.train(model, digits, **{**opts, "replicas": 2}, resume=True)

    res = downpour.train(model, digits, **opts, resume=True)
    assert res.success and res.stop_reason == "max_steps" and res.steps == n, res.message
    assert res.stats["resumed_from"] == first.steps
    # Each partition pushed once a step, for the steps after the checkpoint only.
    assert res.stats["pushes"] == 2 * (n - first.steps)
    # The stop let every partition finish the step under way (PartitionActor.finish): the checkpoint holds
    # exactly the steps it counts, and the two runs together are the uninterrupted one.
    assert len({p["steps"] for p in first.stats["per_partition"]}) == 1, first.stats["per_partition"]
    assert [c["applied"] for c in res.stats["shard_counters"]] == [n, n]
    ref = _reference(model, digits, n, rule="adagrad", lr=0.1, l2=1e-3)
    np.testing.assert_allclose(res.losses[0], ref.losses[first.steps :], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-10, atol=1e-12)
    assert res.history.step.values[0] == first.steps
    assert res.history.time.values[0] == pytest.approx(point.time)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("l2", [0.0, 1e-3])
@pytest.mark.parametrize("a", [0.0, -0.07])
def test_a_partitions_step_rounds_as_the_numpy_expressions(
    compiled: bool, first: bool, l2: float, a: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fused step (one compiled pass, or numpy without numba) must give the floats of the expressions it
    # replaced, bit for bit: ``g = grad / n + l2 * w``, ``acc = g`` or ``acc + g``, ``w - lr * g``.
    from distbelief.downpour import _partition
    from distbelief.storage.internal import kernels

    if not compiled:
        monkeypatch.setattr(kernels, "compiled", lambda fn: None)
        # The module's loops are built once: built now (without numba) they must not outlive this test (a
        # later test found lincomb on its numpy path, with twice the scratch).
        monkeypatch.setattr(kernels, "_module_loops", [])
    rng = np.random.default_rng(7)
    grad, w, acc = (rng.normal(size=40_000) for _ in range(3))
    g = grad / 96
    if l2:
        g += l2 * w
    want_acc = g if first else acc + g
    want_w = w - (-a) * g if a else w.copy()
    _partition.take_step(grad, 96, l2, w, acc, first, a)
    np.testing.assert_array_equal(acc, want_acc)
    np.testing.assert_array_equal(w, want_w)


def test_a_partition_keeps_freed_memory_only_where_the_worker_can_afford_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Keeping freed blocks (storage.reuse_freed_memory) costs up to KEEP_FREE_BYTES of a worker: not for a
    # model split because it is large for its workers (the benchmark's memory case was restarted for it).
    from types import SimpleNamespace

    from distbelief.downpour import _partition
    from distbelief.storage.internal import KEEP_FREE_BYTES

    plan = models.partition_plan(models.MLP([1000, 1000, 10]), 2)
    need = _partition.memory_needed(plan)

    def on_worker(limit: int | None) -> bool:
        worker = SimpleNamespace(memory_manager=SimpleNamespace(memory_limit=limit))
        monkeypatch.setattr(_partition, "current_worker", lambda: worker)
        return _partition._heap_fits(plan)

    assert on_worker(None) and on_worker(2 * (need + KEEP_FREE_BYTES))
    assert not on_worker(2 * (need + KEEP_FREE_BYTES) - 1) and not on_worker(400 * 2**20)
