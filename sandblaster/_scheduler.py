"""Sandblaster's portion scheduler: load balancing, backup copies and exactly-once counting (section 4.2).

One *evaluation* (the objective and its gradient at one point) is split into many more portions than
replicas. Each replica has a queue of the portions it read last time (data affinity). While the replicas
keep pace with each other (:data:`BALANCED_PACE`), each gets its whole queue in one call per evaluation:
on 2 shared cores every message's CPU is taken from the gradient. Until then (the first evaluation, a
straggler) a replica takes work in chunks (its queue split over its free call slots, at most
``push_every`` portions), and a replica whose queue is empty steals, so fast replicas do more: first
portions it already holds in memory, then from the back of the queue that would finish last, but only when
it would finish the stolen portion, reading it included, before its owner reaches it (a cold read costs
several computes). Inside a call, a replica pushes every ``push_every`` portions. When
nothing is left to hand out, idle replicas get *backup copies* of portions still being computed elsewhere
(like MapReduce's backup tasks); the first result wins and the other is dropped.

Exactly once: a replica pushes all of a work call's gradient to every shard before it reports, so a
reported portion is on the shards. The coordinator counts the loss of the first report of each portion;
the shards count each portion's gradient once (``Shard.accumulate``: backup copies and recomputations are
pushed solo and dropped where a summed push covers them). A replica that dies loses only what it had not
pushed: the portions of its unreported calls are recomputed elsewhere and pushed solo, and a shard that
already got some of them from the lost replica's pushes does not count them twice.
"""

from __future__ import annotations

import asyncio
import math
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed import Client, Future
from distributed.utils import sync

from distbelief.errors import ClusterError

__all__ = ["BALANCED_PACE", "EvaluationStats", "PortionScheduler"]

_POLL = 0.25
_LOSS_GRACE = 10.0
_DEAD = ("error", "lost", "cancelled")
#: Before any read was timed, reading a portion is assumed to cost this many times computing it. Measured
#: here: a 67 MB portion (16,768 x 500 float64) takes 30-170 ms to read from the page cache into fresh memory
#: and ~8 ms to compute; 4 is the cautious end.
READ_COST_PRIOR = 4.0
#: Replicas whose paces are all within this factor of the fastest one's are balanced: each gets its whole
#: queue in one call per evaluation. Run-to-run noise between equal replicas here is well under 1.5x; a
#: straggler (the tests' and benchmarks' is 10x) is far over it.
BALANCED_PACE = 1.5


@dataclass
class EvaluationStats:
    """What one evaluation cost."""

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


class PortionScheduler:
    """Hands portions of one evaluation to replica actors; see the module docstring.

    Parameters
    ----------
    client : distributed.Client
        The coordinator's client (its event loop runs the scheduling).
    replicas : list of (Actor, Future)
        The replica actors and the futures that hold them (to notice a dead worker).
    n_portions : int
        Portions per evaluation.
    push_every : int
        A replica pushes its accepted gradient every this many portions.
    backups : bool
        Duplicate outstanding portions onto idle replicas near the end of a batch.
    in_flight : int
        Work calls outstanding per replica, so a replica never idles for a round trip.
    backup_after : float
        A portion is overdue, and worth a backup copy, once it has taken this many times the typical
        time per portion (the fastest replicas' recent pace) times the work queued ahead of it.
    held : list of list of int, optional
        Portions each replica holds in memory already (default: its initial block, which it preloads).
    """

    def __init__(
        self,
        client: Client,
        replicas: list[tuple[Any, Future]],
        n_portions: int,
        *,
        push_every: int = 4,
        backups: bool = True,
        in_flight: int = 2,
        backup_after: float = 2.0,
        held: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.client = client
        self.replicas = list(replicas)
        self.alive = [True] * len(replicas)
        self.n_portions = n_portions
        self.push_every = push_every
        self.backups = backups
        self.in_flight = in_flight
        self.backup_after = backup_after
        #: Round-trip cost of a call to a replica, added to its pace (~1.5 ms here).
        self._call_overhead = 0.002
        #: Seconds per portion of each replica (its own fetch + compute + push, without queueing), learned
        #: from its reports; the fastest one sets when a portion elsewhere counts as overdue.
        self._pace: dict[int, float] = {}
        # Data affinity: replica r starts with the r-th contiguous block of portions, then keeps the
        # portions it computed (and so has in memory) for the next evaluation.
        self.home: list[list[int]] = self.initial_blocks(n_portions, len(replicas))
        #: Portions each replica holds in memory (its preloaded block, then every portion it computed).
        self._cached: list[set[int]] = [set(block) for block in (held or self.home)]
        #: Seconds to read a portion a replica does not hold yet (learned; None until one was read).
        self._read_cost: float | None = None
        self.lost_replicas: list[int] = []
        #: Portions each replica computed (and won) over the run: fast replicas do more.
        self.portions_done: list[int] = [0] * len(replicas)
        #: The order work is sent in: the replica that reported last in the previous evaluation first. It
        #: is on the evaluation's critical path (a replica remote from the shards fetches and pushes over
        #: the network, ~3-5 ms more per evaluation than one beside them), so its call should leave first.
        self.dispatch_order: list[int] = list(range(len(replicas)))

    @staticmethod
    def initial_blocks(n_portions: int, n_replicas: int) -> list[list[int]]:
        """The contiguous block of portions each replica starts with (and preloads)."""
        return [
            list(range(r * n_portions // n_replicas, (r + 1) * n_portions // n_replicas))
            for r in range(n_replicas)
        ]

    def evaluate(
        self, eval_id: int, x_name: str, acc_name: str, prep: Sequence[Sequence[Any]] = ()
    ) -> EvaluationStats:
        """Run one evaluation at the parameters ``x_name``; gradients are summed into ``acc_name``.

        ``prep`` are shard ops to run first, once, fused into the replicas' parameter fetch; their reduced
        results come back in ``EvaluationStats.prep``.
        """
        loop = self.client.loop
        assert loop is not None
        result: EvaluationStats = sync(loop, self._evaluate, eval_id, x_name, acc_name, list(prep))
        return result

    def refresh_shards(self, shard_map: Any) -> None:
        """Point every live replica at ``shard_map`` (after the parameter server rebuilt lost shards)."""
        for r, (actor, _) in enumerate(self.replicas):
            if self.alive[r] and not self._dead(r):
                actor.attach(shard_map).result()

    async def _confirm_dead(self, r: int, exc: BaseException) -> bool:
        """Whether replica ``r``'s worker died (a connection error may come before the scheduler knows)."""
        if self._dead(r):
            return True
        if not isinstance(exc, OSError):
            return False
        deadline = time.perf_counter() + _LOSS_GRACE
        while time.perf_counter() < deadline:
            await asyncio.sleep(_POLL)
            if self._dead(r):
                return True
        return False

    def _steal(
        self, r: int, queues: dict[int, deque[int]], outstanding: Callable[[int], int], chunk: int
    ) -> list[int]:
        """Portions an idle replica ``r`` takes from the others' queues (empty: stealing does not pay).

        Portions ``r`` already holds in memory are free to take. Any other must first be read, which can
        cost several times its compute (see :data:`READ_COST_PRIOR`): take one only
        when ``r`` would finish it, read included, before its owner would reach it.
        """
        donors = [x for x, q in queues.items() if x != r and self.alive[x] and q]
        for x in donors:
            held = [p for p in queues[x] if p in self._cached[r]]
            if held:
                take = held[-chunk:]
                for p in take:
                    queues[x].remove(p)
                return take
        my_pace = self._pace.get(r)

        def owner_finish(x: int) -> float:
            # Unknown pace: the owner has not finished a single call yet, so it is slow.
            return (outstanding(x) + len(queues[x])) * self._pace.get(x, math.inf)

        if not donors:
            return []
        x = max(donors, key=owner_finish)
        if my_pace is not None:
            read = self._read_cost if self._read_cost is not None else READ_COST_PRIOR * my_pace
            if read + my_pace >= owner_finish(x):
                return []
        return [queues[x].pop()]

    def balanced(self) -> bool:
        """Whether every live replica has a known pace within :data:`BALANCED_PACE` of the fastest."""
        paces = [self._pace.get(r) for r in range(len(self.replicas)) if self.alive[r]]
        known = [p for p in paces if p is not None]
        return bool(known) and len(known) == len(paces) and max(known) <= BALANCED_PACE * min(known)

    def lagging(self, r: int) -> bool:
        """Whether replica ``r``'s known pace is more than :data:`BALANCED_PACE` times the fastest live one's.

        A lagging replica takes one portion at a time, one call in flight: whatever it would hold queued
        the others do sooner (they steal it, or back it up once it is overdue).
        """
        pace = self._pace.get(r)
        fastest = min((p for x, p in self._pace.items() if self.alive[x]), default=None)
        return pace is not None and fastest is not None and pace > BALANCED_PACE * fastest

    def _dead(self, r: int) -> bool:
        return self.replicas[r][1].status in _DEAD

    async def _evaluate(
        self, eval_id: int, x_name: str, acc_name: str, prep: list[Sequence[Any]]
    ) -> EvaluationStats:
        t_start = time.perf_counter()
        stats = EvaluationStats()
        live = [r for r in range(len(self.replicas)) if self.alive[r]]
        if not live:
            raise ClusterError("every Sandblaster replica was lost; restart workers and resume the run")
        queues: dict[int, deque[int]] = {r: deque(self.home[r]) for r in live}
        orphans = [p for r in range(len(self.replicas)) if not self.alive[r] for p in self.home[r]]
        for k, p in enumerate(orphans):
            queues[live[k % len(live)]].append(p)
        solo_queue: deque[int] = deque()  # recomputations after a replica was lost: pushed solo
        reported: set[int] = set()  # portions whose loss is counted
        on_shards: set[int] = set()  # portions whose gradient every shard holds
        copies: dict[int, set[int]] = {}  # portion -> replicas computing it now
        work: dict[asyncio.Future[Any], tuple[int, list[int], bool]] = {}
        computed_by: dict[int, list[int]] = {r: [] for r in live}
        order = [r for r in self.dispatch_order if r in queues]  # every live replica, lost ones dropped
        reported_at: dict[int, float] = {}

        def outstanding(r: int) -> int:
            return sum(1 for rr, _, _ in work.values() if rr == r)

        def next_assignment(r: int) -> tuple[list[int], bool]:
            if solo_queue:
                return [solo_queue.popleft()], True
            # The replica's queue is split over its free call slots: few messages (on 2 cores every
            # message's CPU is taken from the gradient), and its next call's portions are computed while
            # the last call's gradient travels. With backups on, an idle replica balances the end of the
            # batch by backing up overdue portions; with backups off, stealing queued portions is the only
            # balance, so a slot's worth stays queued. Measured (benchmarks/sandblaster_vs_peers.py's
            # straggler case, 60k x 500, 16 portions): 39-41 ms per batch instead of 45-50 with a reserve.
            if self.balanced():
                # Every replica keeps pace with the others: nothing to balance, so each gets its whole
                # queue in one call (it still pushes every push_every portions). Measured on 200,000 x 500
                # (12 portions, 2 replicas): 42-43 ms per evaluation against 46-50 ms with two calls each.
                chunk = max(1, len(queues[r]))  # at least 1: it also bounds what an idle replica steals
            else:
                slots = max(1, self.in_flight - outstanding(r)) + int(not self.backups)
                chunk = min(self.push_every, max(1, math.ceil(len(queues[r]) / slots)))
                if self.lagging(r):
                    chunk = 1
            if queues[r]:
                return [queues[r].popleft() for _ in range(min(chunk, len(queues[r])))], False
            if outstanding(r) > 0:
                # Steal only when idle: a busy replica taking a second call's worth from another's queue
                # would take portions that replica has in memory and this one must first read.
                return [], False
            stolen = self._steal(r, queues, outstanding, chunk)
            if stolen:
                return stolen, False
            if self.backups and outstanding(r) == 0:
                # Nothing left to hand out: back up a portion that is overdue on another replica (like
                # MapReduce's backup tasks; a copy of a portion about to finish would only add load).
                now = time.perf_counter()
                candidates = [
                    p
                    for p, who in copies.items()
                    if p not in on_shards and who and r not in who and due.get(p, math.inf) <= now
                ]
                if candidates:
                    p = min(candidates, key=lambda q: (len(copies[q]), q))
                    stats.backups_issued += 1
                    backups.add((r, p))
                    return [p], True
            return [], False

        backups: set[tuple[int, int]] = set()

        due: dict[int, float] = {}  # portion -> when a backup copy of it becomes worth starting

        def send(r: int, portions: list[int], solo: bool) -> None:
            # Every call carries the prep ops: calls to one replica may arrive in any order (separate
            # connections), and whichever runs first fetches; the shards run the ops once per evaluation.
            request = (eval_id, x_name, acc_name, portions, solo, prep, self.push_every)
            call = self.replicas[r][0].work(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
            fut = asyncio.ensure_future(call._result())
            # A call abandoned below (a lost replica's, a backup still running) may fail later: mark its
            # exception seen so asyncio does not log it as never retrieved.
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            work[fut] = (r, portions, solo)
            now = time.perf_counter()
            # Calls queue on a replica: count the work already in flight there.
            ahead = sum(len(pp) for rr, pp, _ in work.values() if rr == r)
            fastest = min((p for x, p in self._pace.items() if self.alive[x]), default=math.inf)
            expected = fastest * ahead
            for p in portions:
                copies.setdefault(p, set()).add(r)
                due.setdefault(p, now + self.backup_after * expected)
            stats.work_calls += 1

        def lose(r: int) -> None:
            """Replica ``r`` died: what it computed but had not reported is recomputed, solo."""
            if not self.alive[r]:
                return
            self.alive[r] = False
            self.lost_replicas.append(r)
            if not any(self.alive[x] for x in live):
                raise ClusterError("every Sandblaster replica was lost; restart workers and resume the run")
            for fut, (rr, _, _) in list(work.items()):
                if rr == r:
                    fut.cancel()
                    work.pop(fut)
            survivors = [x for x in live if self.alive[x]]
            for k, p in enumerate(queues.pop(r, deque())):
                queues[survivors[k % len(survivors)]].append(p)
            for p, who in copies.items():
                who.discard(r)
                if not who and p not in on_shards and p not in solo_queue:
                    # It may have reached some shards before the worker died: re-send it solo.
                    solo_queue.append(p)
                    stats.recomputed += 1

        while len(on_shards) < self.n_portions:
            for r in live:
                if self.alive[r] and self._dead(r):
                    lose(r)
            for r in order:
                limit = 1 if self.lagging(r) else self.in_flight
                while self.alive[r] and outstanding(r) < limit:
                    portions, solo = next_assignment(r)
                    if not portions:
                        break
                    send(r, portions, solo)
            if not work:
                raise ClusterError("no replica could take work; check that the replicas' workers are alive")
            timeout = _POLL
            if self.backups and any(outstanding(r) == 0 for r in live if self.alive[r]):
                waiting = [due[p] for p in copies if p not in on_shards and p in due]
                if waiting:
                    timeout = min(_POLL, max(1e-3, min(waiting) - time.perf_counter()))
            done, _ = await asyncio.wait(list(work), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                if fut not in work:
                    continue  # cancelled by lose() while we waited
                r, portions, solo = work.pop(fut)
                exc = fut.exception()
                if exc is not None:
                    if await self._confirm_dead(r, exc):
                        lose(r)
                        continue
                    raise ClusterError(
                        f"replica {r} failed while computing portions {portions}: {exc!r}"
                    ) from exc
                report = pickle.loads(fut.result())
                reported_at[r] = time.perf_counter()
                reads = len(report["reads"])
                stats.reads += reads
                if reads and report["read_s"] > 0:
                    cost = report["read_s"] / reads
                    self._read_cost = cost if self._read_cost is None else 0.5 * (self._read_cost + cost)
                self._cached[r].update(portions)
                # Calls overlap on a replica (one computes while another pushes): its pace is its compute
                # time, and the fetch when this call made it; waiting behind other calls is not pace.
                fetch_s = report["fetch_s"] if report["fetched"] else 0.0
                busy = report["compute_s"] - report["read_s"] + fetch_s
                pace = busy / max(1, len(portions)) + self._call_overhead
                self._pace[r] = pace if r not in self._pace else 0.5 * (self._pace[r] + pace)
                stats.compute_s += report["compute_s"]
                stats.fetches += int(report["fetched"])
                if report["prep"] and not stats.prep:
                    stats.prep = report["prep"]
                stats.final.update(report["final"])
                for p, loss, rows in report["results"]:
                    copies.get(p, set()).discard(r)
                    if p not in reported:
                        # First result wins: the loss is counted once; the shards dedupe the gradient.
                        reported.add(p)
                        stats.loss_sum += loss
                        stats.rows += rows
                        computed_by[r].append(p)
                        stats.backups_won += int((r, p) in backups)
                    on_shards.add(p)
        self.dispatch_order = sorted(order, key=lambda r: reported_at.get(r, math.inf), reverse=True)
        # Work still running (backup copies on stragglers) is not waited for: the shards refuse its pushes
        # once the next evaluation opens.
        for fut in work:
            fut.cancel()
        for r in live:
            if self.alive[r]:
                self.home[r] = sorted(computed_by[r])
                stats.per_replica[r] = len(computed_by[r])
                self.portions_done[r] += len(computed_by[r])
            else:
                self.home[r] = []
        stats.portions = self.n_portions
        stats.wall_s = time.perf_counter() - t_start
        return stats
