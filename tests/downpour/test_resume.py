"""``downpour.train(..., resume=True)`` continues a run from its last shard checkpoint: parameters, Adagrad
accumulators, shard clocks and the replicas' step and epoch counters, checked in closed form under
:class:`ConstantGradient` (every step's gradient is ``c``: the parameters say how many steps were applied)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
from distributed import Client

from distbelief import downpour
from distbelief.downpour._resume import (
    CHECKPOINT_COST_SHARE,
    CHECKPOINT_LOSS_SHARE,
    MIN_CHECKPOINT_INTERVAL_S,
    checkpoint_interval,
    checkpoint_vector,
    resume_point,
)
from distbelief.errors import InvalidOptionError
from tests.downpour import _helpers
from tests.downpour._helpers import ConstantGradient

cloudpickle.register_pickle_by_value(_helpers)

N = 500
LR = 1e-3
DATA = (np.zeros((600, 1)), np.zeros(600))


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_a_resumed_run_continues_from_its_checkpoint(client: Client, tmp_path: Path, rule: str) -> None:
    model = ConstantGradient(N)
    # Unscaled steps: the closed form counts every applied step at the full rate.
    opts: dict[str, Any] = {"replicas": 2, "rule": rule, "lr": LR, "batch_size": 5, "epochs": 100,
                            "client": client, "staleness_scale": False}  # fmt: skip
    # Stopped by max_steps, which every replica counts itself (2000 of its 6000 steps): a callback's stop
    # lands whenever the driver gets to it, and on a loaded box that was after all 100 epochs.
    first = downpour.train(model, DATA, **opts, store=tmp_path, eval_every=0.01, max_steps=2000)
    assert first.stop_reason == "max_steps"
    point = resume_point(tmp_path)
    assert point is not None and point.final and point.step == first.steps > 0
    assert [p["epoch"] for p in point.replicas] < [100, 100]
    x_ckpt = checkpoint_vector(tmp_path)
    np.testing.assert_array_equal(x_ckpt, first.x)

    res = downpour.train(model, DATA, **opts, store=tmp_path, resume=True)
    assert res.success and res.stop_reason == "epochs", res.message
    assert res.stats["resumed_from"] == first.steps
    per = res.stats["per_replica"]
    # The replicas' counters went on from the checkpoint's: 100 epochs of their 300 rows each in all, exactly
    # (the epoch a replica was in when stopped goes on after the mini-batches it had done).
    assert [st["steps"] for st in per.values()] == [100 * 60] * 2
    assert res.steps == sum(st["steps"] for st in per.values()) > first.steps
    # The history goes on from the checkpoint: the first entry is the checkpoint's parameters, at its time.
    h = res.history
    assert h.time.values[0] == pytest.approx(point.time) and h.step.values[0] == first.steps
    (shard,) = res.stats["shard_counters"]
    if rule == "sgd":
        # Every step of both runs applied exactly once: the parameters continue from the checkpoint's, not x0.
        assert shard["applied_weight"] == res.steps
        np.testing.assert_allclose(res.x, -LR * model.c * res.steps, rtol=1e-9)
    else:
        # The accumulators were restored too (zeroed ones would hold only the second run's pushes).
        acc = checkpoint_vector(tmp_path, "x.adagrad")
        np.testing.assert_allclose(acc, shard["applied_steps_sq"] * model.c**2, rtol=1e-12)
        assert shard["applied_weight"] == res.steps
        assert np.all(res.x < x_ckpt)  # went on descending from the checkpoint
    # The shard clock went on from the checkpoint's.
    assert shard["version"] == shard["applied"] > first.stats["shard_counters"][0]["applied"]


def test_resume_needs_a_checkpoint(client: Client, tmp_path: Path) -> None:
    model = ConstantGradient(N)
    with pytest.raises(InvalidOptionError, match="holds no Downpour checkpoint"):
        downpour.train(model, DATA, max_steps=10, client=client, store=tmp_path, resume=True)
    with pytest.raises(InvalidOptionError, match="needs the store"):
        downpour.train(model, DATA, max_steps=10, client=client, resume=True)
    downpour.train(model, DATA, replicas=2, max_steps=10, client=client, store=tmp_path)
    with pytest.raises(InvalidOptionError, match="resume it with replicas=2"):
        downpour.train(model, DATA, replicas=1, max_steps=10, client=client, store=tmp_path, resume=True)
    # Another model: refused before the shards are opened, the checkpoint left as it was.
    before = resume_point(tmp_path)
    other = ConstantGradient(N + 1)
    with pytest.raises(InvalidOptionError, match=f"holds {N} parameters but the model has {N + 1}"):
        downpour.train(other, DATA, replicas=2, max_steps=10, client=client, store=tmp_path, resume=True)
    assert resume_point(tmp_path) == before


@pytest.mark.parametrize("cost", [0.0, 0.01, 0.5])
@pytest.mark.parametrize("every", [0.5, 5.0, 60.0])
def test_checkpoints_are_paced_by_the_time_trained_and_their_cost(cost: float, every: float) -> None:
    # A kill loses the time since the last checkpoint: within 5% of the time trained, unless the checkpoints
    # would then cost more than 5% of it, and never more than the user's bound.
    for elapsed in [0.0, 1.0, 10.0, 100.0, 1000.0]:
        gap = checkpoint_interval(elapsed, cost, every)
        assert gap <= every
        # Unless capped by the user's bound: at least the minimum, and the checkpoint's cost within 5% of it.
        capped = gap == every
        assert capped or (gap >= MIN_CHECKPOINT_INTERVAL_S and cost <= CHECKPOINT_COST_SHARE * gap + 1e-12)
        assert gap <= max(
            CHECKPOINT_LOSS_SHARE * elapsed, cost / CHECKPOINT_COST_SHARE, MIN_CHECKPOINT_INTERVAL_S
        )
    assert checkpoint_interval(100.0, cost, 0.0) == float("inf")


def test_a_short_run_is_checkpointed_as_it_goes(client: Client, tmp_path: Path) -> None:
    # 3 s of training: with checkpoints 5 s apart a kill lost all of it (issue 27: 21-39% of 15-25 s runs).
    model = ConstantGradient(N)
    res = downpour.train(
        model, DATA, replicas=2, lr=LR, batch_size=5, time_limit=3.0, store=tmp_path, client=client
    )
    assert res.stop_reason == "time_limit", res.message
    # The initial and final ones, and more in between: 5+ on a quiet box; fewer under load, where each
    # costs more and the pacing (at least 20x a checkpoint's cost apart) spreads them out.
    assert res.stats["checkpoints"] >= 3
    off = downpour.train(
        model, DATA, replicas=1, lr=LR, batch_size=5, time_limit=1.0, checkpoint_every_s=0, client=client
    )
    assert off.stats["checkpoints"] == 2  # the initial and the final one only
