"""storage._rounds.RoundOrder: whatever order pushes arrive in, they are released round by round in replica
order, each round's last one marked, and a replica's last push takes it out of later rounds."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.storage._rounds import RoundOrder


def _pushes(rounds_per_replica: list[int]) -> list[tuple[int, int, bool]]:
    return [(k, r, k == n - 1) for r, n in enumerate(rounds_per_replica) for k in range(n)]


def _in_order(rounds_per_replica: list[int]) -> list[tuple[int, int]]:
    most = max(rounds_per_replica)
    return [(k, r) for k in range(most) for r, n in enumerate(rounds_per_replica) if k < n]


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(st.integers(1, 6), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_any_arrival_order_releases_the_same_sequence(rounds: list[int], seed: int) -> None:
    pushes = _pushes(rounds)
    # A replica's own pushes arrive in its order (one channel per shard); replicas interleave at random.
    rng = random.Random(seed)
    queues = {r: [p for p in pushes if p[1] == r] for r in range(len(rounds))}
    arrival = []
    while any(queues.values()):
        r = rng.choice([r for r, q in queues.items() if q])
        arrival.append(queues[r].pop(0))
    order = RoundOrder(len(rounds))
    released: list[tuple[tuple[int, int], bool]] = []
    for k, r, last in arrival:
        released += order.offer(k, r, (k, r), last=last)
    assert [item for item, _ in released] == _in_order(rounds)
    # Each round's last push is marked (the snapshot point), and only it.
    ends = [item for item, completes in released if completes]
    assert ends == [
        max((x for x in _in_order(rounds) if x[0] == k), key=lambda x: x[1]) for k in range(max(rounds))
    ]
    assert order.ready(max(rounds)) and not order.active


def test_a_fetch_waits_for_the_rounds_before_it() -> None:
    order = RoundOrder(2)
    assert order.ready(0) and not order.ready(1)
    assert order.offer(0, 0, "a") == [("a", False)]
    assert not order.ready(1)
    assert order.offer(0, 1, "b") == [("b", True)]
    assert order.ready(1) and not order.ready(2)


def test_a_push_for_a_round_already_done_or_from_a_finished_replica_is_refused() -> None:
    order = RoundOrder(2)
    order.offer(0, 0, "a", last=True)
    order.offer(0, 1, "b")
    with pytest.raises(ValueError, match="replica 0 pushed for round 1"):
        order.offer(1, 0, "c")
    with pytest.raises(ValueError, match="replica 1 pushed for round 0"):
        order.offer(0, 1, "d")
