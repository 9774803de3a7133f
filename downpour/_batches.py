"""Which rows each Downpour replica owns and in which mini-batches it visits them (paper, section 4.1).

"We divide the training data into a number of subsets and run a copy of the model on each of these
subsets": replica ``r`` of ``R`` owns the contiguous rows ``split_rows(n_rows, R)[r]``. It reads them portion
by portion from the zarr dataset, so its rows fall into *segments*, the intersections of its range with the
dataset's portions. Every epoch it walks its segments in order, the rows of each segment shuffled (seeded by
the run's seed, the replica and the epoch), cut into mini-batches; the last batch of a segment may be short.

Plain numpy, no Dask: the single-process reference (:func:`downpour.sequential_sgd`) takes its batches from
the same :class:`BatchPlan`, which is how the tests prove a one-replica run is plain mini-batch SGD.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError

__all__ = ["BatchPlan", "split_rows"]


def split_rows(n_rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, balanced row ranges ``[lo, hi)`` covering ``range(n_rows)``.

    Examples
    --------
    >>> split_rows(10, 3)
    [(0, 3), (3, 6), (6, 10)]
    """
    if parts < 1 or n_rows < parts:
        raise InvalidOptionError(
            f"cannot split {n_rows} rows among {parts} replicas: every replica needs at least one row; "
            "use fewer replicas"
        )
    return [(r * n_rows // parts, (r + 1) * n_rows // parts) for r in range(parts)]


@dataclass(frozen=True)
class BatchPlan:
    """The mini-batches of one replica, epoch by epoch.

    Parameters
    ----------
    segments : tuple of (int, int)
        Global row ranges ``[lo, hi)`` the replica owns, in visiting order (one per dataset portion).
    batch_size : int
        Rows per mini-batch.
    seed : int
        Seed of the shuffles.
    replica : int
        Replica number (part of the shuffle seed, so replicas do not share an order).
    shuffle : bool
        Shuffle the rows of every segment each epoch; otherwise visit them in order.

    Examples
    --------
    >>> plan = BatchPlan(((0, 5), (5, 8)), batch_size=2, seed=0, replica=0, shuffle=False)
    >>> [(s, rows.tolist()) for s, rows in plan.epoch(0)]
    [(0, [0, 1]), (0, [2, 3]), (0, [4]), (1, [0, 1]), (1, [2])]
    >>> plan.batches_per_epoch
    5
    """

    segments: tuple[tuple[int, int], ...]
    batch_size: int
    seed: int = 0
    replica: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise InvalidOptionError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.segments or any(hi <= lo for lo, hi in self.segments):
            raise InvalidOptionError(f"a replica needs non-empty row segments, got {self.segments}")

    @classmethod
    def for_rows(
        cls, dataset: Any, lo: int, hi: int, *, batch_size: int, seed: int, replica: int, shuffle: bool = True
    ) -> BatchPlan:
        """The plan of a replica owning rows ``[lo, hi)`` of ``dataset`` (cut at its portion boundaries)."""
        return cls(
            segments=tuple(_segments(dataset.portion_rows, lo, hi)),
            batch_size=batch_size,
            seed=seed,
            replica=replica,
            shuffle=shuffle,
        )

    @property
    def n_rows(self) -> int:
        """Rows owned (visited once per epoch)."""
        return sum(hi - lo for lo, hi in self.segments)

    @property
    def batches_per_epoch(self) -> int:
        """Mini-batches per epoch."""
        return sum(-(-(hi - lo) // self.batch_size) for lo, hi in self.segments)

    def batches_within(self, rows: int) -> int:
        """How many of an epoch's first mini-batches together hold at most ``rows`` rows: those a replica
        resumed ``rows`` rows into an epoch has done already (it goes on with the next one).

        Examples
        --------
        >>> plan = BatchPlan(((0, 5), (5, 8)), batch_size=2, seed=0, replica=0, shuffle=False)
        >>> [plan.batches_within(r) for r in (0, 1, 2, 5, 6, 8, 99)]
        [0, 0, 1, 3, 3, 5, 5]
        """
        done = count = 0
        for lo, hi in self.segments:
            n = hi - lo
            for start in range(0, n, self.batch_size):
                size = min(self.batch_size, n - start)
                if done + size > rows:
                    return count
                done, count = done + size, count + 1
        return count

    def epoch(self, e: int) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(segment, rows)`` for every mini-batch of epoch ``e``; ``rows`` index into the segment."""
        for s, (lo, hi) in enumerate(self.segments):
            n = hi - lo
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.replica, e, s]).permutation(n)
            else:
                order = np.arange(n)
            for start in range(0, n, self.batch_size):
                yield s, order[start : start + self.batch_size]


def _segments(portion_rows: int, lo: int, hi: int) -> Sequence[tuple[int, int]]:
    out = []
    start = lo
    while start < hi:
        stop = min(hi, (start // portion_rows + 1) * portion_rows)
        out.append((start, stop))
        start = stop
    return out
