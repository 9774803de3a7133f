"""The Downpour driver's decisions as a state machine: no I/O, no clock, no Dask (paper, section 4.1).

The Downpour shell (:class:`downpour._train._Run`, for whole-model replicas and replicas split into
partitions alike) only carries messages; what to do and when is decided here, fed with events that carry
the time they happened (``now``: seconds of the run, a resumed run's counting on from its checkpoint's):

=====================================  ============================================================
event                                  instructions out
=====================================  ============================================================
:meth:`~DriverMachine.tick`            in this order: :class:`Release` (the warm-start is over),
(a poll: the replicas' counters)       :class:`Probe` (new push/fetch errors: was a shard lost?),
                                       :class:`Report` (history rows are due), :class:`Measure`
                                       (the shards' applied counters), :class:`Checkpoint`
:meth:`~DriverMachine.verdict`         none: a history row's divergence or the callback's stop
:meth:`~DriverMachine.checkpointed`    none: paces the next :class:`Checkpoint` by this one's cost
:meth:`~DriverMachine.lose`            whether to rebuild the replica (partitioned runs; else it is
                                       dropped and the others carry on)
:meth:`~DriverMachine.outcome`         the stop reason, or None while the run goes on
=====================================  ============================================================

Examples
--------
>>> m = DriverMachine(replicas=2, checkpoint_every_s=5.0, max_steps=100)
>>> m.tick(0.3, Poll(steps=10))
[Checkpoint()]
>>> m.checkpointed(0.3, cost=0.01)
>>> m.tick(0.35, Poll(steps=100)), m.outcome(0.35, Poll(steps=100))
([], 'max_steps')
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from distbelief.errors import ClusterError

from ._resume import checkpoint_interval

__all__ = [
    "MESSAGES",
    "SUCCESS",
    "Checkpoint",
    "DriverMachine",
    "Instruction",
    "Measure",
    "Poll",
    "Probe",
    "Release",
    "Report",
]

#: Stop reasons that mean the run did what it was asked.
SUCCESS = ("max_steps", "epochs", "time_limit", "callback")
#: Every stop reason in words (a diverged run's says why, from its watchdog).
MESSAGES = {
    "max_steps": "reached max_steps",
    "epochs": "every replica finished its epochs",
    "time_limit": "reached the time limit",
    "callback": "stopped by the callback",
    "diverged": "the training loss became NaN or infinite: lower lr (or use rule='adagrad')",
    "replicas_lost": "every replica was lost with its worker; restart workers and train again from x",
}
#: Seconds between two probes of the shards prompted by new push or fetch errors.
PROBE_GAP_S = 1.0


@dataclass(frozen=True)
class Release:
    """Replica 0's warm-start is over: start the replicas that waited and let replica 0 go on."""


@dataclass(frozen=True)
class Probe:
    """Ping every shard: a replica could not reach one (a lost one is restored, the replicas repointed)."""


@dataclass(frozen=True)
class Report:
    """Make the history rows that are due (and call the callback with them)."""


@dataclass(frozen=True)
class Measure:
    """Measure the shards' applied-push counters."""


@dataclass(frozen=True)
class Checkpoint:
    """Checkpoint the shards with the replicas' counters (then :meth:`DriverMachine.checkpointed`)."""


Instruction = Release | Probe | Report | Measure | Checkpoint


@dataclass(frozen=True)
class Poll:
    """What a poll of the replicas says.

    Attributes
    ----------
    steps : int
        Steps of all replicas together.
    errors : int
        Push and fetch errors of all replicas together, so far.
    done : dict of int to str
        The replicas that ended on their own, and why (``"epochs ..."``, ``"max_steps ..."``).
    diverged : bool
        Whether a replica saw its loss become NaN or infinite.
    holding : bool
        Whether replica 0 waits at the end of its warm-start.
    """

    steps: int = 0
    errors: int = 0
    done: Mapping[int, str] = field(default_factory=dict)
    diverged: bool = False
    holding: bool = False


class DriverMachine:
    """Every decision of a Downpour run's driver.

    Parameters
    ----------
    replicas : int
        Model replicas.
    start : float
        The run's time at its start (a resumed run's: its checkpoint's).
    checkpoint_every_s : float
        The user's bound on the time between checkpoints (:func:`downpour._resume.checkpoint_interval`).
    report_every, measure_every : float
        Seconds between two :class:`Report`, and two :class:`Measure` (``inf``: never; 0: every tick).
    time_limit : float, optional
        The run ends at this time.
    max_steps : int, optional
        The run ends once its replicas took this many steps together.
    warm : bool
        Replica 0 trains alone first; the others wait for a :class:`Release`.
    max_rebuilds : int
        Replicas a run may rebuild after losing their worker (0: a lost replica is dropped).

    Examples
    --------
    >>> m = DriverMachine(replicas=2, checkpoint_every_s=0.0, warm=True)
    >>> m.tick(0.1, Poll(steps=3)), m.tick(0.2, Poll(steps=5, holding=True)), m.waiting
    ([], [Release()], False)
    >>> m.lose(1), m.lose(0), m.outcome(0.3, Poll())
    (False, False, 'replicas_lost')
    """

    def __init__(
        self,
        *,
        replicas: int,
        start: float = 0.0,
        checkpoint_every_s: float = 5.0,
        report_every: float = math.inf,
        measure_every: float = math.inf,
        time_limit: float | None = None,
        max_steps: int | None = None,
        warm: bool = False,
        max_rebuilds: int = 0,
    ) -> None:
        self.alive = [True] * replicas
        self.waiting = warm and replicas > 1
        self.every_s = checkpoint_every_s
        self.report_every, self.measure_every = report_every, measure_every
        self.time_limit, self.max_steps = time_limit, max_steps
        self.max_rebuilds = max_rebuilds
        self.next_ckpt = start + checkpoint_interval(start, 0.0, checkpoint_every_s)
        self.next_report = start + report_every
        self.next_measure = start + measure_every
        self.errors_seen = 0
        self.last_probe = -math.inf
        #: The stop a history row decided (the callback's, or divergence).
        self.stopped: str | None = None
        #: Replicas rebuilt so far, in order (one may be rebuilt more than once).
        self.rebuilt: list[int] = []
        #: Replicas lost for good, in order.
        self.lost: list[int] = []

    def tick(self, now: float, poll: Poll) -> list[Instruction]:
        """The instructions after a poll at ``now``, in the order to carry them out."""
        out: list[Instruction] = []
        if self.waiting and (not self.alive[0] or 0 in poll.done or poll.holding):
            self.waiting = False
            out.append(Release())
        if poll.errors > self.errors_seen and now - self.last_probe > PROBE_GAP_S:
            self.errors_seen, self.last_probe = poll.errors, now
            out.append(Probe())
        if now >= self.next_report and self.stopped is None:
            self.next_report = now + self.report_every
            out.append(Report())
        if now >= self.next_measure:
            self.next_measure = now + self.measure_every
            out.append(Measure())
        if now >= self.next_ckpt:
            self.next_ckpt = math.inf  # until checkpointed() says what it cost
            out.append(Checkpoint())
        return out

    def checkpointed(self, now: float, cost: float) -> None:
        """A :class:`Checkpoint` was carried out (or failed) at ``now`` in ``cost`` seconds."""
        self.next_ckpt = now + checkpoint_interval(now, cost, self.every_s)

    def verdict(self, now: float, *, callback: bool = False, diverged: bool = False) -> None:
        """A history row made at ``now``: whether the callback raised ``StopIteration`` on it, and whether
        the watchdog says the run diverged (the first stop decided is the one that counts)."""
        del now  # a row's time: the stop counts from the first row that decides one
        if self.stopped is None and (callback or diverged):
            self.stopped = "callback" if callback else "diverged"

    def lose(self, r: int) -> bool:
        """Replica ``r`` lost its worker: whether to rebuild it (while the run may; else it is dropped).

        Raises
        ------
        distbelief.errors.ClusterError
            A run that rebuilds replicas has rebuilt ``max_rebuilds`` already.
        """
        if self.max_rebuilds:
            if len(self.rebuilt) >= self.max_rebuilds:
                raise ClusterError(
                    f"replica {r} lost a partition's worker after {self.max_rebuilds} rebuilds; giving up "
                    "(check the workers' health and logs)"
                )
            self.rebuilt.append(r)
            return True
        if self.alive[r]:
            self.alive[r] = False
            self.lost.append(r)
        return False

    def outcome(self, now: float, poll: Poll) -> str | None:
        """Why the run stops after the poll ``poll`` at ``now``; None: it goes on."""
        live = [r for r, a in enumerate(self.alive) if a]
        if self.stopped is not None:
            return self.stopped
        if not live:
            return "replicas_lost"
        if poll.diverged:
            return "diverged"
        if self.time_limit is not None and now >= self.time_limit:
            return "time_limit"
        if self.max_steps is not None and poll.steps >= self.max_steps:
            return "max_steps"
        if not self.waiting and all(r in poll.done for r in live):
            reasons = {poll.done[r].split(" ")[0] for r in live}
            return "epochs" if reasons == {"epochs"} else "max_steps"
        return None
