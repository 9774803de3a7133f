"""Sandblaster's portion scheduling as a state machine: no I/O, no clock, no asyncio (paper, section 4.2).

Section 4.2 ("Sandblaster L-BFGS", load balancing): one *evaluation* (the objective and its gradient at
one point) is split into many more portions than replicas; a free replica gets the next portion, so fast
replicas do more; near the end of the batch, idle replicas get *backup copies* of portions still being
computed elsewhere, the first result wins, and every portion is counted exactly once.

:class:`PortionMachine` makes every one of those decisions. Events go in, each with the time it happened
(``now``, seconds on any monotonic clock), and instructions come out:

=====================================  ============================================================
event                                  instructions out
=====================================  ============================================================
:meth:`~PortionMachine.begin`          none (the next :meth:`~PortionMachine.dispatch` sends work)
:meth:`~PortionMachine.dispatch`       :class:`Send` to every free call slot; once every portion is
(replicas free, a backup timer due)    on the shards, :class:`Cancel` for calls still out, then
                                       :class:`Done` with the evaluation's reduced result
:meth:`~PortionMachine.report`         none (a call's :class:`~sandblaster._messages.WorkReport`)
:meth:`~PortionMachine.lose`           :class:`Cancel` of the lost replica's calls
=====================================  ============================================================

The driver (:class:`sandblaster._scheduler.PortionScheduler`) only carries messages: it sends each
:class:`Send` as a work call, feeds back reports and losses, and wakes :meth:`~PortionMachine.dispatch`
when a call returns or at :meth:`~PortionMachine.next_due`.

Policy (unchanged from the coroutine it came from). Each replica has a queue of the portions it read last
time (data affinity). While the replicas keep pace with each other (:data:`BALANCED_PACE`), each gets its
whole queue in one call per evaluation: on 2 shared cores every message's CPU is taken from the gradient.
Until then (the first evaluation, a straggler) a replica takes work in chunks (its queue split over its
free call slots, at most ``push_every`` portions), and a replica whose queue is empty steals, so fast
replicas do more: first portions it already holds in memory, then from the back of the queue that would
finish last, but only when it would finish the stolen portion, reading it included, before its owner
reaches it (a cold read costs several computes). When nothing is left to hand out, idle replicas get
backup copies of overdue portions (like MapReduce's backup tasks).

Exactly once: a replica pushes all of a work call's gradient to every shard before it reports, so a
reported portion is on the shards. The machine counts the loss of the first report of each portion; the
shards count each portion's gradient once (``Shard.accumulate``: backup copies and recomputations are
pushed solo and dropped where a summed push covers them). A replica that dies loses only what it had not
pushed: the portions of its unreported calls are recomputed elsewhere and pushed solo.

Examples
--------
>>> m = PortionMachine(n_replicas=2, n_portions=4)
>>> m.begin(now=0.0)
>>> [(s.replica, s.portions) for s in m.dispatch(now=0.0)]
[(0, (0,)), (0, (1,)), (1, (2,)), (1, (3,))]
>>> for call in (0, 1, 2, 3):
...     m.report(call, WorkReport(results=((call, 1.0, 10),), compute_s=0.01), now=0.1)
>>> done = m.dispatch(now=0.1)[-1]
>>> done.stats.loss_sum, done.stats.rows
(4.0, 40)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distbelief.errors import ClusterError

from ._messages import WorkReport

__all__ = [
    "BALANCED_PACE",
    "READ_COST_PRIOR",
    "Cancel",
    "Done",
    "EvaluationStats",
    "Instruction",
    "PortionMachine",
    "Send",
]

#: Before any read was timed, reading a portion is assumed to cost this many times computing it. Measured
#: here: a 67 MB portion (16,768 x 500 float64) takes 30-170 ms to read from the page cache into fresh memory
#: and ~8 ms to compute; 4 is the cautious end.
READ_COST_PRIOR = 4.0
#: Replicas whose paces are all within this factor of the fastest one's are balanced: each gets its whole
#: queue in one call per evaluation. Run-to-run noise between equal replicas here is well under 1.5x; a
#: straggler (the tests' and benchmarks' is 10x) is far over it.
BALANCED_PACE = 1.5
#: Round-trip cost of a call to a replica, added to its pace (~1.5 ms here).
CALL_OVERHEAD = 0.002
#: A portion is overdue, and worth a backup copy, once it has taken this many times the typical time per
#: portion (the fastest replicas' recent pace) times the work queued ahead of it.
BACKUP_AFTER = 2.0


@dataclass
class EvaluationStats:
    """What one evaluation cost, and its reduced result (``loss_sum``, ``rows``, ``prep``, ``final``).

    Examples
    --------
    >>> EvaluationStats().portions
    0
    """

    loss_sum: float = 0.0
    rows: int = 0
    portions: int = 0
    backups_issued: int = 0
    backups_won: int = 0
    recomputed: int = 0
    work_calls: int = 0
    fetches: int = 0
    compute_s: float = 0.0
    reads: int = 0
    wall_s: float = 0.0
    per_replica: dict[int, int] = field(default_factory=dict)
    prep: list[Any] = field(default_factory=list)
    final: dict[int, list[Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Send:
    """Send replica ``replica`` a work call for ``portions`` (pushed one by one if ``solo``).

    ``call`` names the call in later events (:meth:`PortionMachine.report`) and instructions
    (:class:`Cancel`).

    Examples
    --------
    >>> Send(call=0, replica=1, portions=(4, 5), solo=False).portions
    (4, 5)
    """

    call: int
    replica: int
    portions: tuple[int, ...]
    solo: bool


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop waiting for call ``call`` (its replica was lost, or the evaluation is over without it).

    Examples
    --------
    >>> Cancel(call=3).call
    3
    """

    call: int


@dataclass(frozen=True, slots=True)
class Done:
    """Every portion is on the shards: the evaluation's result.

    Examples
    --------
    >>> Done(EvaluationStats(loss_sum=1.5)).stats.loss_sum
    1.5
    """

    stats: EvaluationStats


Instruction = Send | Cancel | Done


@dataclass
class _Evaluation:
    """The state of the evaluation under way."""

    t_start: float
    live: list[int]
    order: list[int]
    queues: dict[int, deque[int]]
    stats: EvaluationStats = field(default_factory=EvaluationStats)
    #: Recomputations after a replica was lost: pushed solo.
    solo_queue: deque[int] = field(default_factory=deque)
    #: Portion -> its loss (the first report's), summed exactly when the evaluation is done.
    losses: dict[int, float] = field(default_factory=dict)
    #: Portions whose loss is counted.
    reported: set[int] = field(default_factory=set)
    #: Portions whose gradient every shard holds.
    on_shards: set[int] = field(default_factory=set)
    #: Portion -> replicas computing it now.
    copies: dict[int, set[int]] = field(default_factory=dict)
    #: The calls out, by call number.
    calls: dict[int, Send] = field(default_factory=dict)
    computed_by: dict[int, list[int]] = field(default_factory=dict)
    reported_at: dict[int, float] = field(default_factory=dict)
    #: (replica, portion) of every backup copy issued.
    backups: set[tuple[int, int]] = field(default_factory=set)
    #: Portion -> when a backup copy of it becomes worth starting.
    due: dict[int, float] = field(default_factory=dict)


class PortionMachine:
    """Every scheduling decision of Sandblaster's evaluations; see the module docstring.

    Parameters
    ----------
    n_replicas : int
        Replicas, numbered ``0 .. n_replicas - 1``.
    n_portions : int
        Portions per evaluation.
    push_every : int
        A replica pushes its accepted gradient every this many portions (the largest chunk it is sent
        while the replicas are not balanced).
    backups : bool
        Duplicate outstanding portions onto idle replicas near the end of a batch.
    in_flight : int
        Work calls outstanding per replica, so a replica never idles for a round trip.
    held : list of list of int, optional
        Portions each replica holds in memory already (default: its initial block, which it preloads).

    Examples
    --------
    >>> m = PortionMachine(n_replicas=3, n_portions=7)
    >>> m.home
    [[0, 1, 2], [3, 4], [5, 6]]
    """

    def __init__(
        self,
        n_replicas: int,
        n_portions: int,
        *,
        push_every: int = 4,
        backups: bool = True,
        in_flight: int = 2,
        held: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.n_replicas = n_replicas
        self.n_portions = n_portions
        self.push_every = push_every
        self.backups = backups
        self.in_flight = in_flight
        self.alive = [True] * n_replicas
        #: Seconds per portion of each replica (its own fetch + compute + push, without queueing), learned
        #: from its reports; the fastest one sets when a portion elsewhere counts as overdue.
        self.pace: dict[int, float] = {}
        # Data affinity: replica r starts with the r-th contiguous block of portions, then keeps the
        # portions it computed (and so has in memory) for the next evaluation.
        self.home: list[list[int]] = initial_blocks(n_portions, n_replicas)
        #: Portions each replica holds in memory (its preloaded block, then every portion it computed).
        self.cached: list[set[int]] = [set(block) for block in (held or self.home)]
        #: Seconds to read a portion a replica does not hold yet (learned; None until one was read).
        self.read_cost: float | None = None
        self.lost_replicas: list[int] = []
        #: Portions each replica computed (and won) over the run: fast replicas do more.
        self.portions_done: list[int] = [0] * n_replicas
        #: The order work is sent in: the replica that reported last in the previous evaluation first. It
        #: is on the evaluation's critical path (a replica remote from the shards fetches and pushes over
        #: the network, ~3-5 ms more per evaluation than one beside them), so its call should leave first.
        self.dispatch_order: list[int] = list(range(n_replicas))
        self._ev: _Evaluation | None = None
        self._next_call = 0

    # -- pace rules ------------------------------------------------------------------------------------
    def balanced(self) -> bool:
        """Whether every live replica has a known pace within :data:`BALANCED_PACE` of the fastest."""
        paces = [self.pace.get(r) for r in range(self.n_replicas) if self.alive[r]]
        known = [p for p in paces if p is not None]
        return bool(known) and len(known) == len(paces) and max(known) <= BALANCED_PACE * min(known)

    def lagging(self, r: int) -> bool:
        """Whether replica ``r``'s known pace is more than :data:`BALANCED_PACE` times the fastest live one's.

        A lagging replica takes one portion at a time, one call in flight: whatever it would hold queued
        the others do sooner (they steal it, or back it up once it is overdue).
        """
        pace = self.pace.get(r)
        fastest = self._fastest()
        return pace is not None and fastest is not None and pace > BALANCED_PACE * fastest

    def _fastest(self) -> float | None:
        return min((p for x, p in self.pace.items() if self.alive[x]), default=None)

    def steal(
        self, r: int, queues: dict[int, deque[int]], outstanding: Callable[[int], int], chunk: int
    ) -> list[int]:
        """Portions an idle replica ``r`` takes from the others' ``queues`` (empty: stealing does not pay).

        Portions ``r`` already holds in memory are free to take (up to ``chunk`` of them, from one
        queue). Any other must first be read, which can cost several times its compute (see
        :data:`READ_COST_PRIOR`): take one only when ``r`` would finish it, read included, before its owner
        would reach it (``outstanding(x)`` calls in flight, then its queue).
        """
        donors = [x for x, q in queues.items() if x != r and self.alive[x] and q]
        for x in donors:
            held = [p for p in queues[x] if p in self.cached[r]]
            if held:
                take = held[-chunk:]
                for p in take:
                    queues[x].remove(p)
                return take
        my_pace = self.pace.get(r)

        def owner_finish(x: int) -> float:
            # Unknown pace: the owner has not finished a single call yet, so it is slow.
            return (outstanding(x) + len(queues[x])) * self.pace.get(x, math.inf)

        if not donors:
            return []
        x = max(donors, key=owner_finish)
        if my_pace is not None:
            read = self.read_cost if self.read_cost is not None else READ_COST_PRIOR * my_pace
            if read + my_pace >= owner_finish(x):
                return []
        return [queues[x].pop()]

    # -- events ----------------------------------------------------------------------------------------
    @property
    def live(self) -> list[int]:
        """The replicas alive now."""
        return [r for r in range(self.n_replicas) if self.alive[r]]

    @property
    def complete(self) -> bool:
        """Whether every portion of the evaluation under way is on the shards."""
        return self._ev is not None and len(self._ev.on_shards) >= self.n_portions

    def outstanding(self, r: int) -> int:
        """Work calls out to replica ``r`` in the evaluation under way."""
        ev = self._ev
        return 0 if ev is None else sum(1 for s in ev.calls.values() if s.replica == r)

    def begin(self, now: float) -> None:
        """Event: an evaluation starts. Queues each live replica's portions (a lost one's go round-robin
        to the living); raises ClusterError if no replica is alive."""
        live = self.live
        if not live:
            raise ClusterError("every Sandblaster replica was lost; restart workers and resume the run")
        queues: dict[int, deque[int]] = {r: deque(self.home[r]) for r in live}
        orphans = [p for r in range(self.n_replicas) if not self.alive[r] for p in self.home[r]]
        for k, p in enumerate(orphans):
            queues[live[k % len(live)]].append(p)
        self._ev = _Evaluation(
            t_start=now,
            live=live,
            # Every live replica, lost ones dropped.
            order=[r for r in self.dispatch_order if r in queues],
            queues=queues,
            computed_by={r: [] for r in live},
        )

    def dispatch(self, now: float) -> list[Instruction]:
        """Event: replicas may be free, or a backup copy due. Fills every free call slot with a
        :class:`Send`; once every portion is on the shards, :class:`Cancel` of each call still out and
        :class:`Done`. Raises ClusterError if no call is out and none could be sent."""
        ev = self._evaluation()
        if len(ev.on_shards) >= self.n_portions:
            return self._finish(ev, now)
        out: list[Instruction] = []
        for r in ev.order:
            limit = 1 if self.lagging(r) else self.in_flight
            while self.alive[r] and self.outstanding(r) < limit:
                portions, solo = self._next_assignment(ev, r, now)
                if not portions:
                    break
                out.append(self._send(ev, r, portions, solo, now))
        if not ev.calls:
            raise ClusterError("no replica could take work; check that the replicas' workers are alive")
        return out

    def next_due(self) -> float | None:
        """When the earliest backup copy becomes due, if a replica is idle to take it (else None): the
        driver should call :meth:`dispatch` by then even if no call returns."""
        ev = self._ev
        if ev is None or not self.backups or all(self.outstanding(r) for r in ev.live if self.alive[r]):
            return None
        waiting = [ev.due[p] for p in ev.copies if p not in ev.on_shards and p in ev.due]
        return min(waiting, default=None)

    def report(self, call: int, report: WorkReport, now: float) -> None:
        """Event: call ``call`` returned ``report`` (every shard holds its gradient). A call this machine
        no longer waits for (cancelled, or of an evaluation that is over) is ignored."""
        ev = self._ev
        send = None if ev is None else ev.calls.pop(call, None)
        if ev is None or send is None:
            return
        r, portions, stats = send.replica, send.portions, ev.stats
        ev.reported_at[r] = now
        reads = len(report.reads)
        stats.reads += reads
        if reads and report.read_s > 0:
            cost = report.read_s / reads
            self.read_cost = cost if self.read_cost is None else 0.5 * (self.read_cost + cost)
        self.cached[r].update(portions)
        # Calls overlap on a replica (one computes while another pushes): its pace is its compute time,
        # and the fetch when this call made it; waiting behind other calls is not pace.
        fetch_s = report.fetch_s if report.fetched else 0.0
        busy = report.compute_s - report.read_s + fetch_s
        pace = busy / max(1, len(portions)) + CALL_OVERHEAD
        self.pace[r] = pace if r not in self.pace else 0.5 * (self.pace[r] + pace)
        stats.compute_s += report.compute_s
        stats.fetches += int(report.fetched)
        if report.prep and not stats.prep:
            stats.prep = list(report.prep)
        stats.final.update(report.final)
        for p, loss, rows in report.results:
            ev.copies.get(p, set()).discard(r)
            if p not in ev.reported:
                # First result wins: the loss is counted once; the shards dedupe the gradient.
                ev.reported.add(p)
                ev.losses[p] = loss
                stats.rows += rows
                ev.computed_by[r].append(p)
                stats.backups_won += int((r, p) in ev.backups)
            ev.on_shards.add(p)

    def lose(self, r: int) -> list[Instruction]:
        """Event: replica ``r`` died. Its calls are cancelled, its queue goes to the survivors, and what it
        was computing with no other copy out is recomputed, solo. Raises ClusterError if none is left."""
        if not self.alive[r]:
            return []
        self.alive[r] = False
        self.lost_replicas.append(r)
        ev = self._ev
        if not any(self.alive):
            raise ClusterError("every Sandblaster replica was lost; restart workers and resume the run")
        if ev is None:
            return []
        cancels: list[Instruction] = [Cancel(c) for c, s in ev.calls.items() if s.replica == r]
        for c in cancels:
            assert isinstance(c, Cancel)
            del ev.calls[c.call]
        survivors = [x for x in ev.live if self.alive[x]]
        for k, p in enumerate(ev.queues.pop(r, deque())):
            ev.queues[survivors[k % len(survivors)]].append(p)
        for p, who in ev.copies.items():
            who.discard(r)
            if not who and p not in ev.on_shards and p not in ev.solo_queue:
                # It may have reached some shards before the worker died: re-send it solo.
                ev.solo_queue.append(p)
                ev.stats.recomputed += 1
        return cancels

    def replace(self, r: int) -> list[Instruction]:
        """Event: replica ``r`` lost a worker and was rebuilt (a partitioned replica's partition started
        again elsewhere). Its calls are cancelled and what they carried with no other copy out is
        recomputed, solo (it may have reached some shards); it keeps its queue and goes on working.

        Examples
        --------
        >>> m = PortionMachine(n_replicas=1, n_portions=2); m.begin(now=0.0)
        >>> sends = m.dispatch(now=0.0)
        >>> [type(i).__name__ for i in m.replace(0)], [s.portions for s in m.dispatch(now=0.0)]
        (['Cancel', 'Cancel'], [(0,), (1,)])
        """
        ev = self._ev
        if ev is None or not self.alive[r]:
            return []
        cancels: list[Instruction] = [Cancel(c) for c, s in ev.calls.items() if s.replica == r]
        for c in cancels:
            assert isinstance(c, Cancel)
            del ev.calls[c.call]
        for p, who in ev.copies.items():
            if r in who:
                who.discard(r)
                if not who and p not in ev.on_shards and p not in ev.solo_queue:
                    ev.solo_queue.append(p)
                    ev.stats.recomputed += 1
        return cancels

    # -- decisions -------------------------------------------------------------------------------------
    def _evaluation(self) -> _Evaluation:
        if self._ev is None:
            raise RuntimeError("no evaluation under way: call begin() first")
        return self._ev

    def _next_assignment(self, ev: _Evaluation, r: int, now: float) -> tuple[list[int], bool]:
        if ev.solo_queue:
            return [ev.solo_queue.popleft()], True
        queues = ev.queues
        # The replica's queue is split over its free call slots: few messages (on 2 cores every message's
        # CPU is taken from the gradient), and its next call's portions are computed while the last call's
        # gradient travels. With backups on, an idle replica balances the end of the batch by backing up
        # overdue portions; with backups off, stealing queued portions is the only balance, so a slot's
        # worth stays queued. Measured (benchmarks/sandblaster_vs_peers.py's straggler case, 60k x 500,
        # 16 portions): 39-41 ms per batch instead of 45-50 with a reserve.
        if self.balanced():
            # Every replica keeps pace with the others: nothing to balance, so each gets its whole queue
            # in one call (it still pushes every push_every portions). Measured on 200,000 x 500 (12
            # portions, 2 replicas): 42-43 ms per evaluation against 46-50 ms with two calls each.
            chunk = max(1, len(queues[r]))  # at least 1: it also bounds what an idle replica steals
        else:
            slots = max(1, self.in_flight - self.outstanding(r)) + int(not self.backups)
            chunk = min(self.push_every, max(1, math.ceil(len(queues[r]) / slots)))
            if self.lagging(r):
                chunk = 1
        if queues[r]:
            return [queues[r].popleft() for _ in range(min(chunk, len(queues[r])))], False
        if self.outstanding(r) > 0:
            # Steal only when idle: a busy replica taking a second call's worth from another's queue would
            # take portions that replica has in memory and this one must first read.
            return [], False
        stolen = self.steal(r, queues, self.outstanding, chunk)
        if stolen:
            return stolen, False
        if self.backups:
            # Nothing left to hand out: back up a portion that is overdue on another replica (like
            # MapReduce's backup tasks; a copy of a portion about to finish would only add load).
            candidates = [
                p
                for p, who in ev.copies.items()
                if p not in ev.on_shards and who and r not in who and ev.due.get(p, math.inf) <= now
            ]
            if candidates:
                p = min(candidates, key=lambda q: (len(ev.copies[q]), q))
                ev.stats.backups_issued += 1
                ev.backups.add((r, p))
                return [p], True
        return [], False

    def _send(self, ev: _Evaluation, r: int, portions: list[int], solo: bool, now: float) -> Send:
        send = Send(call=self._next_call, replica=r, portions=tuple(portions), solo=solo)
        self._next_call += 1
        ev.calls[send.call] = send
        # Calls queue on a replica: count the work already in flight there, this call's included.
        ahead = sum(len(s.portions) for s in ev.calls.values() if s.replica == r)
        fastest = self._fastest()
        expected = (math.inf if fastest is None else fastest) * ahead
        for p in portions:
            ev.copies.setdefault(p, set()).add(r)
            ev.due.setdefault(p, now + BACKUP_AFTER * expected)
        ev.stats.work_calls += 1
        return send

    def _finish(self, ev: _Evaluation, now: float) -> list[Instruction]:
        # A replica that reported nothing (it had no work: fewer portions than replicas) goes last, not
        # first: first, it would take (steal) the portion its neighbour holds, and the two would swap it
        # every evaluation (measured on digits, 1 portion: every other evaluation on the replica remote
        # from the shard, two more round trips each).
        self.dispatch_order = sorted(ev.order, key=lambda r: ev.reported_at.get(r, -math.inf), reverse=True)
        # Work still running (backup copies on stragglers) is not waited for: the shards refuse its pushes
        # once the next evaluation opens.
        out: list[Instruction] = [Cancel(c) for c in ev.calls]
        stats = ev.stats
        orphans: list[int] = []
        for r in ev.live:
            if self.alive[r]:
                self.home[r] = sorted(ev.computed_by[r])
                stats.per_replica[r] = len(ev.computed_by[r])
                self.portions_done[r] += len(ev.computed_by[r])
            else:
                orphans += ev.computed_by[r]
                self.home[r] = []
        # What a replica lost after it reported is dealt to the survivors, or the next evaluation would
        # never send it (found by the state machine's interleaving test).
        survivors = self.live
        for k, p in enumerate(sorted(orphans)):
            self.home[survivors[k % len(survivors)]].append(p)
        for r in survivors:
            self.home[r].sort()
        # Summed exactly (correctly rounded), so the objective's bits do not depend on which report came
        # first (issue 18, item 6: reproducible runs).
        stats.loss_sum = math.fsum(ev.losses.values())
        stats.portions = self.n_portions
        stats.wall_s = now - ev.t_start
        self._ev = None
        out.append(Done(stats))
        return out


def initial_blocks(n_portions: int, n_replicas: int) -> list[list[int]]:
    """The contiguous block of portions each replica starts with (and preloads).

    The first replicas get the one more portion when they do not divide evenly: by default replica ``r``
    and shard ``r`` share worker ``r``, and replica 0 is beside shard 0, which a one-shard run's fetches
    and pushes go to (a replica there moves its parameters and gradient without a round trip; a single
    portion, as on a small problem, goes there).

    Examples
    --------
    >>> initial_blocks(5, 2)
    [[0, 1, 2], [3, 4]]
    >>> initial_blocks(1, 2)
    [[0], []]
    """
    base, extra = divmod(n_portions, n_replicas)
    starts = [r * base + min(r, extra) for r in range(n_replicas + 1)]
    return [list(range(starts[r], starts[r + 1])) for r in range(n_replicas)]
