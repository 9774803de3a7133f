"""The portion scheduler's decisions on their own (no cluster): what an idle replica may steal.

The end-to-end behaviour (exactly-once counting, backups, lost replicas) is tested on a real LocalCluster in
test_minimize.py; here the stealing rule is pinned down case by case.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distbelief.sandblaster._scheduler import BALANCED_PACE, READ_COST_PRIOR, PortionScheduler


def scheduler(n_portions: int, held: list[list[int]] | None = None) -> PortionScheduler:
    fake: Any = None
    return PortionScheduler(fake, [(fake, fake), (fake, fake)], n_portions, held=held)


def test_initial_blocks_cover_every_portion_once() -> None:
    for n in range(1, 20):
        for replicas in range(1, 6):
            blocks = PortionScheduler.initial_blocks(n, replicas)
            assert sorted(p for b in blocks for p in b) == list(range(n))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_portions_the_thief_holds_are_taken_first_and_for_free() -> None:
    s = scheduler(8, held=[[0, 1, 2, 3, 6], [4, 5, 6, 7]])
    s._pace = {0: 0.001, 1: 0.001}  # the owner is as fast: a cold read would never pay
    queues = {0: deque[int](), 1: deque([5, 6, 7])}
    assert s._steal(0, queues, lambda r: 0, chunk=2) == [6]
    assert list(queues[1]) == [5, 7]


def test_a_cold_portion_is_not_stolen_from_an_owner_about_to_reach_it() -> None:
    s = scheduler(8)
    s._pace = {0: 0.010, 1: 0.010}
    queues = {0: deque[int](), 1: deque([7])}
    # Owner: one call in flight and one queued portion = 20 ms; thief: read (4 x 10 ms) + 10 ms = 50 ms.
    assert s._steal(0, queues, lambda r: int(r == 1), chunk=1) == []
    assert list(queues[1]) == [7]


def test_a_cold_portion_is_stolen_from_a_slow_owner() -> None:
    s = scheduler(8)
    s._pace = {0: 0.010, 1: 0.100}  # a 10x straggler
    queues = {0: deque[int](), 1: deque([5, 6, 7])}
    assert s._steal(0, queues, lambda r: int(r == 1), chunk=2) == [7]


def test_an_owner_that_never_reported_counts_as_slow() -> None:
    s = scheduler(8)
    s._pace = {0: 0.010}
    queues = {0: deque[int](), 1: deque([6, 7])}
    assert s._steal(0, queues, lambda r: 0, chunk=1) == [7]


def test_the_measured_read_cost_replaces_the_prior() -> None:
    s = scheduler(8)
    s._pace = {0: 0.010, 1: 0.010}
    queues = {0: deque[int](), 1: deque([4, 5, 6, 7])}
    # Owner finishes in 40 ms: with the prior (40 ms read + 10 ms) stealing does not pay...
    assert READ_COST_PRIOR * 0.010 + 0.010 >= 0.040
    assert s._steal(0, queues, lambda r: 0, chunk=1) == []
    # ...with a measured 5 ms read (data in the page cache) it does.
    s._read_cost = 0.005
    assert s._steal(0, queues, lambda r: 0, chunk=1) == [7]


@given(
    queue=st.lists(st.integers(0, 15), unique=True, max_size=8),
    held=st.sets(st.integers(0, 15)),
    my_pace=st.floats(1e-4, 1.0),
    owner_pace=st.floats(1e-4, 1.0),
    in_flight=st.integers(0, 3),
)
def test_stealing_only_moves_portions_between_queues(
    queue: list[int], held: set[int], my_pace: float, owner_pace: float, in_flight: int
) -> None:
    s = scheduler(16, held=[sorted(held), list(range(16))])
    s._pace = {0: my_pace, 1: owner_pace}
    queues = {0: deque[int](), 1: deque(queue)}
    taken = s._steal(0, queues, lambda r: in_flight if r == 1 else 0, chunk=3)
    assert sorted(taken + list(queues[1])) == sorted(queue)
    assert len(taken) <= 3
    if any(p in held for p in queue):
        assert taken and all(p in held for p in taken)  # free portions first
    elif taken:
        assert len(taken) == 1 and taken[0] == queue[-1]  # one cold portion, from the back
        assert READ_COST_PRIOR * my_pace + my_pace < (in_flight + len(queue)) * owner_pace


@pytest.mark.parametrize("n_portions", [1, 2, 7])
def test_held_portions_default_to_the_initial_blocks(n_portions: int) -> None:
    s = scheduler(n_portions)
    assert [sorted(c) for c in s._cached] == PortionScheduler.initial_blocks(n_portions, 2)


@given(
    paces=st.lists(st.one_of(st.none(), st.floats(1e-4, 1.0)), min_size=2, max_size=2),
    alive=st.lists(st.booleans(), min_size=2, max_size=2).filter(any),
)
def test_replicas_are_balanced_when_every_live_pace_is_known_and_close(
    paces: list[float | None], alive: list[bool]
) -> None:
    s = scheduler(8)
    s._pace = {r: p for r, p in enumerate(paces) if p is not None}
    s.alive = alive
    live = [p for p, a in zip(paces, alive, strict=True) if a]
    expected = None not in live and max(live) <= BALANCED_PACE * min(live)  # type: ignore[type-var]
    assert s.balanced() == expected


def test_a_straggler_unbalances_and_an_unknown_pace_is_not_balanced() -> None:
    s = scheduler(8)
    assert not s.balanced()
    s._pace = {0: 0.01}
    assert not s.balanced()
    s._pace = {0: 0.01, 1: 0.012}
    assert s.balanced()
    s._pace = {0: 0.01, 1: 0.1}
    assert not s.balanced()
    s.alive = [True, False]  # the straggler was lost: the survivor is balanced on its own
    assert s.balanced()


def test_a_replica_is_lagging_only_past_the_balanced_pace_of_the_fastest_live_one() -> None:
    s = scheduler(8)
    assert not s.lagging(0)  # no pace known yet
    s._pace = {0: 0.010}
    assert not s.lagging(0)
    s._pace = {0: 0.010 * BALANCED_PACE, 1: 0.010}
    assert not s.lagging(0) and not s.lagging(1)
    s._pace = {0: 0.100, 1: 0.010}  # a 10x straggler takes one portion at a time
    assert s.lagging(0) and not s.lagging(1)
    s.alive[1] = False  # the fast one is gone: the straggler is the fastest left
    assert not s.lagging(0)
