"""The portion scheduler's state machine, driven directly: no cluster, no event loop, a clock of our own.

``PortionMachine`` takes events (an evaluation begins, replicas are free or a backup copy is due, a call
reports, a replica is lost) and answers with instructions (send, cancel, done). Here a fake world carries
those: its replicas "compute" known per-portion losses and gradients and push them into real
``storage._shard.Shard`` objects (whose ``accumulate`` dedupes backup copies), so every interleaving
hypothesis draws must still count every portion exactly once, with the same bits of the gradient and the
loss whatever the interleaving (issue 18, item 6: reproducible runs). The end-to-end
behaviour on a real LocalCluster is in test_minimize.py.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.errors import ClusterError, ProtocolError
from distbelief.sandblaster._messages import WorkCall, WorkReport, decode, encode
from distbelief.sandblaster._portions import (
    BALANCED_PACE,
    READ_COST_PRIOR,
    Cancel,
    Done,
    EvaluationStats,
    Instruction,
    PortionMachine,
    Send,
    initial_blocks,
)
from distbelief.storage import Shard
from distbelief.storage.internal import exactsum

ACC = "acc"
N_PARAMS = 5


def machine(n_portions: int, held: list[list[int]] | None = None, **kwargs: object) -> PortionMachine:
    return PortionMachine(2, n_portions, held=held, **kwargs)  # type: ignore[arg-type]


# -- the fake world ----------------------------------------------------------------------------------------
@dataclass
class World:
    """Replicas that compute known losses and gradients and push them into real shards."""

    n_portions: int
    push_every: int
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    shards: list[Shard] = field(default_factory=list)
    epoch: int = 0

    def __post_init__(self) -> None:
        self.shards = [Shard(0, 0, 2), Shard(1, 2, N_PARAMS)]
        # Of very different magnitudes: a float sum of these depends on its order.
        self.losses = list(
            self.rng.standard_normal(self.n_portions) * 10.0 ** self.rng.integers(-8, 8, self.n_portions)
        )
        self.rows = [10 + p for p in range(self.n_portions)]
        self.grads = self.rng.standard_normal((self.n_portions, N_PARAMS)) * 10.0 ** self.rng.integers(
            -8, 8, (self.n_portions, 1)
        )
        # The one gradient every interleaving must give, bit for bit: the portions summed in index order.
        reference = exactsum.zeros(N_PARAMS)
        for grad in self.grads:
            exactsum.deposit(reference, grad)
        self.gradient = exactsum.value(reference)

    def open(self) -> None:
        self.epoch += 1
        for shard in self.shards:
            shard.reset_accumulator(ACC, self.epoch)

    def groups(self, send: Send) -> list[list[int]]:
        """What the replica pushes for a call, in order (as ``Replica.compute`` groups it)."""
        if send.solo:
            return [[p] for p in send.portions]
        step = self.push_every
        return [list(send.portions[k : k + step]) for k in range(0, len(send.portions), step)]

    def push(self, send: Send, epoch: int, groups: int, shards_of_next: int = 0) -> None:
        """Push the first ``groups`` groups to every shard, and the next one to ``shards_of_next`` shards."""
        todo = self.groups(send)
        for k, group in enumerate(todo[: groups + 1]):
            # As Replica.compute pushes: one portion as it is, several as their binned sum.
            grad = self.grads[group[0]]
            if len(group) > 1:
                grad = exactsum.zeros(N_PARAMS)
                for p in group:
                    exactsum.deposit(grad, self.grads[p])
            for shard in self.shards[: len(self.shards) if k < groups else shards_of_next]:
                part = grad[..., shard.lo : shard.hi]
                shard.accumulate(ACC, part, group, epoch=epoch, solo=send.solo)

    def report(self, send: Send, pace: float) -> WorkReport:
        self.push(send, self.epoch, len(self.groups(send)))
        return WorkReport(
            results=tuple((p, self.losses[p], self.rows[p]) for p in send.portions),
            fetched=True,
            compute_s=pace * len(send.portions),
        )

    def check(self, stats: EvaluationStats, m: PortionMachine) -> None:
        """Every portion counted exactly once: loss, rows, gradient, and the replicas' next queues."""
        assert stats.loss_sum == math.fsum(self.losses)
        assert stats.rows == sum(self.rows)
        assert stats.portions == self.n_portions
        # A replica lost after it reported is not in per_replica: what it computed counts all the same.
        assert sum(stats.per_replica.values()) <= self.n_portions
        assert set(stats.per_replica) == set(m.live)
        assert stats.backups_won <= stats.backups_issued
        gradient = []
        for shard in self.shards:
            assert shard.settle(ACC) == list(range(self.n_portions))
            gradient.append(shard.vector(ACC))
        assert np.array_equal(np.concatenate(gradient), self.gradient)  # ==: the same bits
        assert sorted(p for block in m.home for p in block) == list(range(self.n_portions))
        assert all(not m.home[r] for r in m.lost_replicas)


class Calls:
    """The driver's side: the calls out, fed by the machine's instructions."""

    def __init__(self) -> None:
        self.out: dict[int, Send] = {}
        self.cancelled: list[Send] = []
        self.done: EvaluationStats | None = None

    def carry(self, instructions: list[Instruction]) -> None:
        for ins in instructions:
            assert self.done is None, "nothing follows Done"
            if isinstance(ins, Send):
                assert ins.call not in self.out
                assert ins.portions and (not ins.solo or len(ins.portions) == 1)
                self.out[ins.call] = ins
            elif isinstance(ins, Cancel):
                self.cancelled.append(self.out.pop(ins.call))
            else:
                self.done = ins.stats


# -- every interleaving counts every portion once --------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    n_replicas=st.integers(1, 4),
    n_portions=st.integers(1, 12),
    push_every=st.integers(1, 4),
    in_flight=st.integers(1, 3),
    backups=st.booleans(),
    paces=st.lists(st.sampled_from([0.001, 0.002, 0.01, 0.1]), min_size=4, max_size=4),
    evaluations=st.integers(1, 3),
    data=st.data(),
)
def test_any_interleaving_of_reports_losses_rebuilds_and_timers_counts_every_portion_once(
    n_replicas: int,
    n_portions: int,
    push_every: int,
    in_flight: int,
    backups: bool,
    paces: list[float],
    evaluations: int,
    data: st.DataObject,
) -> None:
    m = PortionMachine(n_replicas, n_portions, push_every=push_every, backups=backups, in_flight=in_flight)
    world = World(n_portions, push_every)
    now = 0.0
    late: list[tuple[Send, int]] = []  # calls cancelled when their evaluation ended: still running
    for _ in range(evaluations):
        world.open()
        calls = Calls()
        m.begin(now)
        calls.carry(m.dispatch(now))
        for step in range(400):
            if calls.done is not None:
                break
            actions = ["report"] * 4 + ["tick", "late", "replace"]
            if len(m.live) > 1:
                actions.append("lose")
            action = data.draw(st.sampled_from(actions)) if step < 300 else "report"
            if action == "report" and calls.out:
                send = calls.out.pop(data.draw(st.sampled_from(sorted(calls.out))))
                m.report(send.call, world.report(send, paces[send.replica]), now)
            elif action in ("lose", "replace"):
                r = data.draw(st.sampled_from(m.live))
                dying = [s for s in calls.out.values() if s.replica == r]
                for send in dying:
                    # Died half-way: some groups on every shard, the next on some of them (a partitioned
                    # replica's surviving partitions may have pushed a group their lost peer had not).
                    groups = data.draw(st.integers(0, len(world.groups(send)) - 1))
                    world.push(send, world.epoch, groups, data.draw(st.integers(0, len(world.shards))))
                # "replace": the replica was rebuilt (a partitioned one's lost partition started again).
                calls.carry(m.lose(r) if action == "lose" else m.replace(r))
                assert not any(s.replica == r for s in calls.out.values())
            elif action == "late" and late:
                # A straggler's copy from an evaluation that is over: the shards and the machine ignore it.
                send, epoch = late.pop()
                world.push(send, epoch, len(world.groups(send)))
                m.report(send.call, WorkReport(results=((send.portions[0], 1e9, 1),)), now)
            now += data.draw(st.sampled_from([0.0, 0.001, 0.01, 0.5]))
            calls.carry(m.dispatch(now))
        assert calls.done is not None
        assert not calls.out, "every call still out is cancelled at the end"
        late += [(send, world.epoch) for send in calls.cancelled if send.replica in m.live]
        world.check(calls.done, m)


# -- a discrete-event world: replicas compute one call after another at their own pace --------------------
def simulate(
    m: PortionMachine, paces: list[float], world: World, t0: float = 0.0
) -> tuple[EvaluationStats, float]:
    """One evaluation with replica ``r`` taking ``paces[r]`` seconds per portion, checked with
    :meth:`World.check`; returns its stats and the time it ended."""
    world.open()
    calls = Calls()
    free_at = [t0] * len(paces)
    finishing: list[tuple[float, int]] = []
    m.begin(t0)
    now = t0
    while True:
        before = set(calls.out)
        calls.carry(m.dispatch(now))
        if calls.done is not None:
            world.check(calls.done, m)
            return calls.done, now
        for c in sorted(set(calls.out) - before):
            send = calls.out[c]
            free_at[send.replica] = max(free_at[send.replica], now) + paces[send.replica] * len(send.portions)
            heapq.heappush(finishing, (free_at[send.replica], c))
        due = m.next_due()
        t, c = finishing[0]
        if due is not None and due < t:
            now = max(now, due)  # a timer: dispatch again, maybe a backup copy
            continue
        heapq.heappop(finishing)
        now = t
        finished = calls.out.pop(c, None)  # None: cancelled when its replica was lost
        if finished is not None:
            m.report(c, world.report(finished, paces[finished.replica]), now)


def run(
    m: PortionMachine, world: World, paces: list[list[float]], now: float = 0.0
) -> tuple[list[EvaluationStats], float]:
    """:func:`simulate` one evaluation per entry of ``paces``, one after the other."""
    out = []
    for p in paces:
        stats, now = simulate(m, p, world, now)
        out.append(stats)
    return out, now


def test_balanced_replicas_get_one_call_each_per_evaluation() -> None:
    m = PortionMachine(2, 15, push_every=2, backups=False)
    (first, *balanced), _ = run(m, World(15, push_every=2), [[0.01, 0.01]] + [[0.01, 0.011]] * 2)
    # Unknown paces: in_flight = 2 calls of push_every = 2 portions each, then one call for the rest.
    assert first.work_calls >= 6
    assert [stats.work_calls for stats in balanced] == [2, 2]
    assert m.balanced()


def test_a_ten_times_slower_replica_does_less_work() -> None:
    m = PortionMachine(2, 16, push_every=4)
    (*_, last), _ = run(m, World(16, push_every=4), [[0.1, 0.01]] * 5)
    assert m.lagging(0) and not m.lagging(1)
    slow, fast = m.portions_done
    assert fast >= 4 * slow, (slow, fast)
    # The last evaluation takes about the fast replica's share, not the slow one's 8 portions at 0.1 s.
    assert last.wall_s < 0.5 * 8 * 0.1


def test_a_stalled_replica_is_backed_up_and_the_backup_wins() -> None:
    m = PortionMachine(2, 8, push_every=4)
    world = World(8, push_every=4)
    _, now = run(m, world, [[0.01, 0.01]] * 2)
    assert m.balanced()
    stats, end = simulate(m, [0.01, 10.0], world, now)  # replica 1 stalls: 40 s for its 4 portions
    assert stats.backups_issued >= 1 and stats.backups_won >= 1
    assert end - now < 1.0
    assert stats.per_replica[0] > stats.per_replica[1]


def test_without_backups_nothing_is_copied() -> None:
    m = PortionMachine(2, 8, push_every=2, backups=False)
    runs, _ = run(m, World(8, push_every=2), [[0.01, 0.01], [0.01, 1.0], [0.01, 1.0]])
    assert [stats.backups_issued for stats in runs] == [0, 0, 0]
    assert m.next_due() is None


def test_the_replica_that_reported_last_gets_its_work_first_next_time() -> None:
    m = PortionMachine(2, 8, push_every=4, backups=False)
    world = World(8, push_every=4)
    assert m.dispatch_order == [0, 1]
    orders = []
    now = 0.0
    for slow in (1, 1, 0, 0):
        _, now = simulate(m, [0.5 if r == slow else 0.01 for r in range(2)], world, now)
        orders.append(list(m.dispatch_order))
    assert orders == [[1, 0], [1, 0], [0, 1], [0, 1]]
    m.begin(now)
    assert next(s.replica for s in m.dispatch(now) if isinstance(s, Send)) == 0


@pytest.mark.parametrize("held", [None, [[0], [0]]])
def test_fewer_portions_than_replicas_stay_on_the_first_replica(held: list[list[int]] | None) -> None:
    """One portion, two replicas both holding it in memory (a small problem run twice on the cluster): it
    is computed by replica 0 (beside shard 0) every time, not swapped between the replicas (the idle one
    was dispatched first and took it), which cost a run on digits two more round trips every other
    evaluation."""
    assert initial_blocks(1, 2) == [[0], []] and initial_blocks(3, 2) == [[0, 1], [2]]
    m = machine(1, held=held)
    runs, _ = run(m, World(1, push_every=4), [[0.001, 0.001]] * 6)
    assert [stats.per_replica for stats in runs] == [{0: 1, 1: 0}] * 6
    assert m.portions_done == [6, 0] and m.dispatch_order[0] == 0


def test_a_lost_replica_costs_only_its_unreported_portions_recomputed_solo() -> None:
    world = World(8, push_every=4)
    world.open()
    m = PortionMachine(2, 8, push_every=4, in_flight=1)
    calls = Calls()
    m.begin(0.0)
    calls.carry(m.dispatch(0.0))
    (to_0,) = [s for s in calls.out.values() if s.replica == 0]
    (to_1,) = [s for s in calls.out.values() if s.replica == 1]
    m.report(to_0.call, world.report(calls.out.pop(to_0.call), 0.01), 0.1)
    world.push(to_1, world.epoch, 0, shards_of_next=1)  # its push reached one shard, then it died
    calls.carry(m.lose(1))
    assert to_1 in calls.cancelled and m.lost_replicas == [1]
    sent: list[Send] = []
    while True:
        new = m.dispatch(0.2)
        calls.carry(new)
        if calls.done is not None:
            break
        sent += [s for s in new if isinstance(s, Send)]
        for send in list(calls.out.values()):
            m.report(send.call, world.report(calls.out.pop(send.call), 0.01), 0.2)
    # The lost call's portions, and nothing else, are recomputed by the survivor, each pushed alone.
    assert [s.portions for s in sent] == [(p,) for p in to_1.portions]
    assert all(s.replica == 0 and s.solo for s in sent)
    stats = calls.done
    world.check(stats, m)
    assert stats.recomputed == len(to_1.portions)
    assert m.home[1] == [] and m.live == [0]
    # The next evaluation gives everything to the survivor; losing it too leaves no one.
    m.begin(0.3)
    assert sorted(m.home[0]) == list(range(8))
    assert {s.replica for s in m.dispatch(0.3) if isinstance(s, Send)} == {0}
    with pytest.raises(ClusterError, match="every Sandblaster replica was lost"):
        m.lose(0)


def test_an_evaluation_with_every_replica_lost_does_not_begin() -> None:
    m = machine(4)
    m.lose(0)
    with pytest.raises(ClusterError, match="every Sandblaster replica was lost"):
        m.lose(1)
    with pytest.raises(ClusterError, match="every Sandblaster replica was lost"):
        m.begin(0.0)


def test_a_report_for_a_call_it_no_longer_waits_for_changes_nothing() -> None:
    m = machine(2)
    m.begin(0.0)
    sends = [s for s in m.dispatch(0.0) if isinstance(s, Send)]
    m.report(10_000, WorkReport(results=((0, 5.0, 1),)), 0.1)
    for s in sends:
        m.report(s.call, WorkReport(results=tuple((p, 1.0, 1) for p in s.portions)), 0.1)
    m.report(sends[0].call, WorkReport(results=((0, 5.0, 1),)), 0.1)  # reported twice
    (done,) = m.dispatch(0.1)
    assert isinstance(done, Done) and done.stats.loss_sum == 2.0 and done.stats.rows == 2
    with pytest.raises(RuntimeError, match="begin"):
        m.dispatch(0.2)


# -- the rules, case by case -----------------------------------------------------------------------------
def test_initial_blocks_cover_every_portion_once() -> None:
    for n in range(1, 20):
        for replicas in range(1, 6):
            blocks = initial_blocks(n, replicas)
            assert sorted(p for b in blocks for p in b) == list(range(n))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_portions_the_thief_holds_are_taken_first_and_for_free() -> None:
    m = machine(8, held=[[0, 1, 2, 3, 6], [4, 5, 6, 7]])
    m.pace = {0: 0.001, 1: 0.001}  # the owner is as fast: a cold read would never pay
    queues = {0: deque[int](), 1: deque([5, 6, 7])}
    assert m.steal(0, queues, lambda r: 0, chunk=2) == [6]
    assert list(queues[1]) == [5, 7]


def test_a_cold_portion_is_not_stolen_from_an_owner_about_to_reach_it() -> None:
    m = machine(8)
    m.pace = {0: 0.010, 1: 0.010}
    queues = {0: deque[int](), 1: deque([7])}
    # Owner: one call in flight and one queued portion = 20 ms; thief: read (4 x 10 ms) + 10 ms = 50 ms.
    assert m.steal(0, queues, lambda r: int(r == 1), chunk=1) == []
    assert list(queues[1]) == [7]


def test_a_cold_portion_is_stolen_from_a_slow_owner() -> None:
    m = machine(8)
    m.pace = {0: 0.010, 1: 0.100}  # a 10x straggler
    queues = {0: deque[int](), 1: deque([5, 6, 7])}
    assert m.steal(0, queues, lambda r: int(r == 1), chunk=2) == [7]


def test_an_owner_that_never_reported_counts_as_slow() -> None:
    m = machine(8)
    m.pace = {0: 0.010}
    queues = {0: deque[int](), 1: deque([6, 7])}
    assert m.steal(0, queues, lambda r: 0, chunk=1) == [7]


def test_the_measured_read_cost_replaces_the_prior() -> None:
    m = machine(8)
    m.pace = {0: 0.010, 1: 0.010}
    queues = {0: deque[int](), 1: deque([4, 5, 6, 7])}
    # Owner finishes in 40 ms: with the prior (40 ms read + 10 ms) stealing does not pay...
    assert READ_COST_PRIOR * 0.010 + 0.010 >= 0.040
    assert m.steal(0, queues, lambda r: 0, chunk=1) == []
    # ...with a measured 5 ms read (data in the page cache) it does.
    m.read_cost = 0.005
    assert m.steal(0, queues, lambda r: 0, chunk=1) == [7]


def test_a_report_teaches_pace_read_cost_and_what_the_replica_holds() -> None:
    m = machine(4, held=[[0, 1], []])
    m.begin(0.0)
    sends = [s for s in m.dispatch(0.0) if isinstance(s, Send)]
    to_1 = next(s for s in sends if s.replica == 1)
    report = WorkReport(
        results=tuple((p, 1.0, 1) for p in to_1.portions),
        fetched=True,
        fetch_s=0.004,
        compute_s=0.030,
        read_s=0.020,
        reads=to_1.portions,
    )
    m.report(to_1.call, report, 0.1)
    n = len(to_1.portions)
    # Pace: compute without the reads, plus the fetch this call made, per portion, plus a call's cost.
    assert m.pace[1] == pytest.approx((0.030 - 0.020 + 0.004) / n + 0.002)
    assert m.read_cost == pytest.approx(0.020 / n)
    assert set(to_1.portions) <= m.cached[1]


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
    m = machine(16, held=[sorted(held), list(range(16))])
    m.pace = {0: my_pace, 1: owner_pace}
    queues = {0: deque[int](), 1: deque(queue)}
    taken = m.steal(0, queues, lambda r: in_flight if r == 1 else 0, chunk=3)
    assert sorted(taken + list(queues[1])) == sorted(queue)
    assert len(taken) <= 3
    if any(p in held for p in queue):
        assert taken and all(p in held for p in taken)  # free portions first
    elif taken:
        assert len(taken) == 1 and taken[0] == queue[-1]  # one cold portion, from the back
        assert READ_COST_PRIOR * my_pace + my_pace < (in_flight + len(queue)) * owner_pace


@pytest.mark.parametrize("n_portions", [1, 2, 7])
def test_held_portions_default_to_the_initial_blocks(n_portions: int) -> None:
    m = machine(n_portions)
    assert [sorted(c) for c in m.cached] == initial_blocks(n_portions, 2)


@given(
    paces=st.lists(st.one_of(st.none(), st.floats(1e-4, 1.0)), min_size=2, max_size=2),
    alive=st.lists(st.booleans(), min_size=2, max_size=2).filter(any),
)
def test_replicas_are_balanced_when_every_live_pace_is_known_and_close(
    paces: list[float | None], alive: list[bool]
) -> None:
    m = machine(8)
    m.pace = {r: p for r, p in enumerate(paces) if p is not None}
    m.alive = alive
    live = [p for p, a in zip(paces, alive, strict=True) if a]
    known = [p for p in live if p is not None]
    expected = len(known) == len(live) and max(known) <= BALANCED_PACE * min(known)
    assert m.balanced() == expected


def test_a_straggler_unbalances_and_an_unknown_pace_is_not_balanced() -> None:
    m = machine(8)
    assert not m.balanced()
    m.pace = {0: 0.01}
    assert not m.balanced()
    m.pace = {0: 0.01, 1: 0.012}
    assert m.balanced()
    m.pace = {0: 0.01, 1: 0.1}
    assert not m.balanced()
    m.alive = [True, False]  # the straggler was lost: the survivor is balanced on its own
    assert m.balanced()


def test_a_replica_is_lagging_only_past_the_balanced_pace_of_the_fastest_live_one() -> None:
    m = machine(8)
    assert not m.lagging(0)  # no pace known yet
    m.pace = {0: 0.010}
    assert not m.lagging(0)
    m.pace = {0: 0.010 * BALANCED_PACE, 1: 0.010}
    assert not m.lagging(0) and not m.lagging(1)
    m.pace = {0: 0.100, 1: 0.010}  # a 10x straggler takes one portion at a time
    assert m.lagging(0) and not m.lagging(1)
    m.alive[1] = False  # the fast one is gone: the straggler is the fastest left
    assert not m.lagging(0)


def test_a_lagging_replica_takes_one_portion_in_one_call() -> None:
    m = machine(8)
    m.pace = {0: 0.100, 1: 0.010}
    m.begin(0.0)
    sends = [s for s in m.dispatch(0.0) if isinstance(s, Send)]
    assert [s.portions for s in sends if s.replica == 0] == [(0,)]
    assert len([s for s in sends if s.replica == 1]) == 2


# -- the messages ----------------------------------------------------------------------------------------
def test_messages_travel_as_one_frame_and_are_checked_on_arrival() -> None:
    call = WorkCall(7, "x", "acc", (1, 2), True, (("fill", "acc", 0.0),), 3)
    frame = encode(call)
    assert isinstance(frame, bytes) and decode(frame, WorkCall) == call
    report = WorkReport(results=((1, 0.5, 10),), final={0: [1.0]}, fetched=True, reads=(1,))
    assert decode(encode(report), WorkReport) == report
    with pytest.raises(ProtocolError, match="expected a WorkReport, got a WorkCall"):
        decode(frame, WorkReport)
    assert math.isclose(decode(encode(WorkReport(compute_s=0.25)), WorkReport).compute_s, 0.25)
