"""The Downpour driver's decisions (``downpour._driver.DriverMachine``), without a cluster."""

from __future__ import annotations

import pytest

from distbelief.downpour._driver import (
    Checkpoint,
    DriverMachine,
    Measure,
    Poll,
    Probe,
    Release,
    Report,
)
from distbelief.downpour._resume import checkpoint_interval
from distbelief.errors import ClusterError


def test_the_warm_start_ends_when_replica_0_holds_finishes_or_is_lost() -> None:
    for ended in ({"holding": True}, {"done": {0: "epochs"}}, None):
        m = DriverMachine(replicas=3, checkpoint_every_s=0.0, warm=True)
        assert m.tick(0.1, Poll(steps=5)) == [] and m.waiting
        # Replica 0 alone is done (or not), the others have not started: the run is not over.
        assert m.outcome(0.1, Poll(steps=5)) is None
        if ended is None:
            m.lose(0)
            ended = {}
        assert m.tick(0.2, Poll(steps=5, **ended)) == [Release()]
        assert m.tick(0.3, Poll(steps=5, **ended)) == []
    # Without warm-start (or with one replica) nobody waits.
    assert not DriverMachine(replicas=1, warm=True).waiting


def test_new_errors_probe_the_shards_at_most_once_a_second() -> None:
    m = DriverMachine(replicas=2, checkpoint_every_s=0.0)
    assert m.tick(0.1, Poll(errors=0)) == []
    assert m.tick(0.2, Poll(errors=2)) == [Probe()]
    assert m.tick(0.5, Poll(errors=5)) == []  # too soon after the last probe
    assert m.tick(1.3, Poll(errors=5)) == [Probe()]
    assert m.tick(2.5, Poll(errors=5)) == []  # no new errors


@pytest.mark.parametrize("start", [0.0, 40.0])
def test_checkpoints_are_paced_by_the_run_time_and_their_cost(start: float) -> None:
    m = DriverMachine(replicas=1, start=start, checkpoint_every_s=5.0)
    due = start + checkpoint_interval(start, 0.0, 5.0)
    assert m.tick(due - 0.01, Poll()) == [] and m.tick(due, Poll()) == [Checkpoint()]
    assert m.tick(due + 100.0, Poll()) == []  # not again before the last one is done
    m.checkpointed(due + 100.0, cost=0.5)
    later = due + 100.0 + checkpoint_interval(due + 100.0, 0.5, 5.0)
    assert m.tick(later - 0.01, Poll()) == [] and m.tick(later, Poll()) == [Checkpoint()]
    # 0: only the initial checkpoint.
    assert DriverMachine(replicas=1, checkpoint_every_s=0.0).tick(1e9, Poll()) == []


def test_reports_and_measures_come_at_their_cadence_in_order() -> None:
    m = DriverMachine(replicas=1, checkpoint_every_s=1.0, report_every=0.2, measure_every=1.0)
    assert m.tick(0.1, Poll()) == []
    assert m.tick(0.2, Poll()) == [Report()]
    assert m.tick(0.3, Poll()) == [Checkpoint()]  # the first checkpoint, at 0.25 s
    assert m.tick(1.0, Poll(errors=1)) == [Probe(), Report(), Measure()]
    assert DriverMachine(replicas=1, report_every=0.0).tick(0.0, Poll()) == [Report()]


def test_the_first_stop_a_row_decides_counts_and_comes_before_the_replicas_counters() -> None:
    m = DriverMachine(replicas=2, checkpoint_every_s=0.0, report_every=0.0, max_steps=10)
    m.verdict(1.0, callback=True, diverged=True)
    m.verdict(1.1, diverged=True)
    assert m.outcome(1.1, Poll(steps=10, diverged=True)) == "callback"
    m.lose(0), m.lose(1)
    assert m.outcome(1.2, Poll()) == "callback"  # decided before the replicas were lost
    assert m.tick(1.2, Poll()) == []  # no more reports once stopped
    d = DriverMachine(replicas=1, checkpoint_every_s=0.0)
    d.verdict(1.0, diverged=True)
    assert d.outcome(1.0, Poll()) == "diverged"


@pytest.mark.parametrize(
    ("poll", "now", "reason"),
    [
        (Poll(steps=5), 1.0, None),
        (Poll(steps=5, diverged=True), 1.0, "diverged"),
        (Poll(steps=5), 2.0, "time_limit"),
        (Poll(steps=10), 1.0, "max_steps"),
        (Poll(steps=5, done={0: "epochs"}), 1.0, None),  # replica 1 goes on
        (Poll(steps=5, done={0: "epochs", 1: "epochs 3"}), 1.0, "epochs"),
        (Poll(steps=5, done={0: "epochs", 1: "max_steps"}), 1.0, "max_steps"),
    ],
)
def test_the_run_ends_for_the_first_reason_that_holds(poll: Poll, now: float, reason: str | None) -> None:
    m = DriverMachine(replicas=2, checkpoint_every_s=0.0, time_limit=2.0, max_steps=10)
    assert m.outcome(now, poll) == reason


def test_a_lost_replica_is_dropped_or_rebuilt_within_the_limit() -> None:
    m = DriverMachine(replicas=2)
    assert not m.lose(1) and not m.lose(1) and m.lost == [1] and m.alive == [True, False]
    # Replica 0's being done ends the run: replica 1 is no longer waited for.
    assert m.outcome(0.0, Poll(done={0: "epochs"})) == "epochs"
    assert not m.lose(0) and m.outcome(0.0, Poll()) == "replicas_lost"
    p = DriverMachine(replicas=2, max_rebuilds=2)
    assert p.lose(1) and p.lose(1) and p.rebuilt == [1, 1]
    with pytest.raises(ClusterError, match="after 2 rebuilds; giving up"):
        p.lose(0)
    assert p.alive == [True, True] and p.lost == [] and p.outcome(0.0, Poll()) is None
