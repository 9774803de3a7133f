"""Downpour survives the loss of a replica's worker and of a shard's worker (SIGKILL mid-run), with the
right answer: under :class:`ConstantGradient` the shards' vectors are known in closed form from the pushes
they applied, which the shards count themselves (``Shard.counters``, checkpointed with the vectors)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
from distributed import Client, LocalCluster

from distbelief import downpour
from distbelief.downpour import Progress
from distbelief.downpour._resume import checkpoint_vector
from tests.downpour import _helpers
from tests.downpour._helpers import ConstantGradient

# The test model lives in this test package, which the workers cannot import: ship it by value.
cloudpickle.register_pickle_by_value(_helpers)

N = 3000
LR = 1e-3
#: Rows of the constant-gradient model (their values do not matter: every row's gradient is ``c``).
DATA = (np.zeros((2000, 1)), np.zeros(2000))


def killer(cluster: LocalCluster, address: str, at: float, log: list[float]) -> Callable[[Progress], None]:
    """A callback that SIGKILLs the worker process at ``address`` once ``at`` seconds have passed."""

    def callback(progress: Progress) -> None:
        if not log and progress.time >= at:
            nanny = next(w for w in cluster.workers.values() if w.worker_address == address)
            assert nanny.process is not None and nanny.process.pid is not None
            os.kill(nanny.process.pid, signal.SIGKILL)
            log.append(progress.time)

    return callback


def test_a_killed_replica_worker_leaves_the_others_training(
    three_workers: tuple[LocalCluster, Client, list[str]], tmp_path: Path
) -> None:
    cluster, client, (a, b, c) = three_workers
    killed: list[float] = []
    model = ConstantGradient(N)
    res = downpour.train(
        model, DATA, replicas=3, rule="sgd", lr=LR, batch_size=5, time_limit=2.5, eval_every=0.05,
        shard_workers=[a], replica_workers=[b, c, c], client=client, store=tmp_path,
        max_loss_growth=None,  # ConstantGradient's loss is linear and unbounded: no divergence to watch
        callback=killer(cluster, b, 0.5, killed),
    )  # fmt: skip
    h = res.history
    assert killed and res.success and res.stop_reason == "time_limit"
    assert res.stats["lost_replicas"] == [0]
    assert h.replicas_alive.values[0] == 3 and h.replicas_alive.values[-1] == 2
    # Updates applied on the shard (counted there), not replica steps: the survivors' pushes kept landing.
    (shard,) = res.stats["shard_counters"]
    at_kill = int(h.applied.sel(time=killed[0], method="nearest").values[0])
    assert shard["applied"] == h.applied.values[-1, 0] > at_kill + 20
    # The answer: the shard's vector is exactly the sum of the pushes it applied, the dead replica's
    # included (no update lost or applied twice, whatever was in flight when the worker died) ...
    np.testing.assert_allclose(res.x, -LR * model.c * shard["applied_weight"], rtol=1e-9)
    # ... and every push the replicas saw applied is among them (the dead replica's last report is a lower
    # bound: it pushed more before it died).
    per = res.stats["per_replica"]
    survivors = sum(per[r]["applied_weight"][0] for r in (1, 2))
    assert survivors + per[0]["applied_weight"][0] <= shard["applied_weight"]


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_a_lost_shard_is_restored_from_its_checkpoint_and_training_continues(
    three_workers: tuple[LocalCluster, Client, list[str]], tmp_path: Path, rule: str
) -> None:
    cluster, client, (a, b, c) = three_workers
    killed: list[float] = []
    model = ConstantGradient(N)
    res = downpour.train(
        model, DATA, replicas=2, rule=rule, lr=LR, batch_size=5, time_limit=3.0,  # type: ignore[arg-type]
        eval_every=0.05, checkpoint_every_s=0.2, shard_workers=[b], replica_workers=[a, c],
        callback=killer(cluster, b, 0.8, killed), client=client, store=tmp_path,
        max_loss_growth=None,  # ConstantGradient's loss is linear and unbounded: no divergence to watch
    )  # fmt: skip
    h = res.history
    assert killed and res.success and res.stop_reason == "time_limit"
    assert res.stats["recoveries"] >= 1 and res.stats["lost_replicas"] == []
    lost_at, lost = res.stats["shard_losses"][0]
    assert lost == 0 and lost_at >= killed[0]
    assert np.all(h.sel(time=slice(lost_at, None)).replicas_alive.values == 2)
    assert res.stats["checkpoints"] >= 3
    (shard,) = res.stats["shard_counters"]
    per = res.stats["per_replica"]
    # The pushes the lost shard had applied since its checkpoint are gone (the replicas saw them applied) ...
    reported = sum(st["applied_weight"][0] for st in per.values())
    assert reported - shard["applied_weight"] > 0
    # ... and the restored shard kept counting from its checkpoint: many pushes landed on it after.
    applied = h.applied.values[:, 0]
    before = applied[h.time.values < killed[0]].max()
    assert shard["applied"] == applied[-1] > before + 20
    # The answer: the restored shard is its checkpoint plus the pushes applied after it, in closed form.
    # (A shard restored as zeros, or with the counters but not the vectors of its checkpoint, is off by the
    # checkpoint's share.)
    if rule == "sgd":
        np.testing.assert_allclose(res.x, -LR * model.c * shard["applied_weight"], rtol=1e-9)
    else:
        # Adagrad: the accumulators hold (k c)^2 for every applied push of k steps; each coordinate moved by
        # lr * k / sqrt(sum k^2) per push, the same for all of them.
        acc = checkpoint_vector(tmp_path, "x.adagrad")
        np.testing.assert_allclose(acc, shard["applied_steps_sq"] * model.c**2, rtol=1e-12)
        np.testing.assert_allclose(res.x, res.x[0], rtol=1e-8)
        assert shard["applied_steps_sq"] >= shard["applied"] > 0
