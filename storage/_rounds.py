"""Deterministic Downpour on a shard: pushes applied in a fixed order, fetches answered at round starts.

``downpour.train(deterministic=True)`` trades asynchrony for the same bits on every rerun. Each replica
works in *rounds* of ``n`` steps (``n = n_fetch = n_push``): at the start of round ``k`` it fetches the
parameters as they are after every push of rounds ``0 .. k-1``, takes its ``n`` local steps, and pushes
their sum as its round-``k`` push. Every shard applies the pushes round by round, and within a round in
replica order (0, 1, ...), whatever order they arrive in; a replica that is done (its last push is marked)
drops out of later rounds. So the parameters a replica starts a round from, the staleness of every push and
the shards' final state depend on the data, the seed and the replica count only, not on timing.

The cost: replicas wait for each other at every round start (the slowest one sets the pace, as in
synchronous SGD with a staleness of one round), and a shard keeps one copy of its slice (the round start's
parameters) for the fetches of the round. A lost shard is rebuilt without this order; a run with
``time_limit`` or a callback stop ends at a time-dependent step.

:class:`RoundOrder` is the pure bookkeeping (no Dask, no asyncio); the shard actor feeds it and waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RoundOrder"]


@dataclass
class RoundOrder:
    """Which pushes may be applied now: round by round, replica order within a round.

    Parameters
    ----------
    replicas : int
        Replicas taking part (numbered ``0 .. replicas-1``).

    Examples
    --------
    >>> order = RoundOrder(2)
    >>> order.offer(0, 1, "r1 round 0")         # replica 0 goes first in round 0: wait
    []
    >>> order.offer(0, 0, "r0 round 0")         # now both, in order; the second one completes round 0
    [('r0 round 0', False), ('r1 round 0', True)]
    >>> order.round, order.ready(1), order.ready(2)
    (1, True, False)
    >>> order.offer(1, 0, "r0 round 1, its last", last=True)
    [('r0 round 1, its last', False)]
    >>> order.offer(1, 1, "r1 round 1"), order.offer(2, 1, "r1 round 2")   # replica 0 is out of round 2
    ([('r1 round 1', True)], [('r1 round 2', True)])
    """

    replicas: int
    #: The round being applied: every push of earlier rounds is applied.
    round: int = 0
    active: list[int] = field(default_factory=list)
    #: Index into :attr:`active` of the replica whose push of :attr:`round` is applied next.
    position: int = 0
    finishing: set[int] = field(default_factory=set)
    waiting: dict[tuple[int, int], tuple[Any, bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.active = list(range(self.replicas))

    def offer(self, round_: int, replica: int, item: Any, *, last: bool = False) -> list[tuple[Any, bool]]:
        """Push ``item`` of ``replica`` for round ``round_`` arrived; returns the items to apply now, in
        order, each with whether applying it completes its round (the round start's snapshot is taken right
        after it). ``last``: the replica's final push, it takes no part in later rounds."""
        if replica not in self.active or round_ < self.round:
            raise ValueError(f"replica {replica} pushed for round {round_}, but the shard is at {self.round}")
        self.waiting[(round_, replica)] = (item, last)
        out: list[tuple[Any, bool]] = []
        while self.active and (self.round, self.active[self.position]) in self.waiting:
            who = self.active[self.position]
            got, is_last = self.waiting.pop((self.round, who))
            if is_last:
                self.finishing.add(who)
            self.position += 1
            out.append((got, self.position == len(self.active)))
            if self.position == len(self.active):
                self.round += 1
                self.position = 0
                self.active = [r for r in self.active if r not in self.finishing]
                self.finishing.clear()
        return out

    def ready(self, round_: int) -> bool:
        """Whether every push of the rounds before ``round_`` is applied (a fetch for ``round_`` may go)."""
        return self.round >= round_ or not self.active
