"""Shards aligned to a model's partitions: "parameters follow partitions" (paper, section 3, Figure 2).

A partitioned model (``models.partition_plan``) owns contiguous ranges of the partition-major parameter
vector; a layout whose shard boundaries include every partition boundary lets partition ``k`` fetch from and
push to only the shards inside its own range.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from distbelief.errors import InvalidOptionError

from ._layout import DEFAULT_TARGET_CHUNK, Layout

__all__ = ["partition_layout", "partition_shards"]


def partition_layout(
    bounds: Sequence[int], *, shards_per_partition: int = 1, target_chunk: int = DEFAULT_TARGET_CHUNK
) -> Layout:
    """A layout whose shards tile every partition's range ``bounds[k]:bounds[k+1]``.

    Each partition's range is split into ``shards_per_partition`` shards.

    The zarr chunk is as large as the shards allow (up to ``target_chunk``) while the padding that keeps
    each shard on chunks of its own (:meth:`Layout.offsets`) stays under 1/16 of ``n``. Partition boundaries
    are seldom multiples of a common large number, so the chunk no longer has to divide them: that made
    it 1 for most models.

    Parameters
    ----------
    bounds : sequence of int
        ``0 = bounds[0] < bounds[1] < ... < bounds[K] = n``.
    shards_per_partition : int
        Shards per partition (each partition's range split evenly).
    target_chunk : int
        Largest zarr chunk wanted.

    Raises
    ------
    distbelief.errors.InvalidOptionError
        If a partition owns no parameters (use fewer partitions) or the bounds are not increasing.

    Examples
    --------
    >>> partition_layout([0, 6, 10]).ranges()
    [(0, 6), (6, 10)]
    >>> partition_layout([0, 6, 10], shards_per_partition=2).ranges()
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    b = [int(x) for x in bounds]
    if len(b) < 2 or b[0] != 0:
        raise InvalidOptionError(f"partition bounds must start at 0 and have at least 2 entries, got {b}")
    for k in range(len(b) - 1):
        if b[k + 1] <= b[k]:
            raise InvalidOptionError(
                f"partition {k} owns no parameters (bounds {b}); use fewer partitions than the narrowest "
                "layer has units"
            )
    if shards_per_partition < 1:
        raise InvalidOptionError(f"shards_per_partition must be >= 1, got {shards_per_partition}")
    out = [0]
    for lo, hi in itertools.pairwise(b):
        pieces = min(shards_per_partition, hi - lo)
        out += [lo + (i * (hi - lo)) // pieces for i in range(1, pieces)] + [hi]
    return Layout(n=out[-1], chunk=_chunk_for(out, max(1, target_chunk)), bounds=tuple(out))


def _chunk_for(bounds: Sequence[int], target: int) -> int:
    """The largest chunk ``ceil(widest / j) <= target`` whose padding is at most ``n / 16``.

    ``j = 1`` gives one chunk per shard (padding: how much narrower each shard is than the widest); larger
    ``j`` cut the padding, and once the chunk is at most ``n / (16 * shards)`` it is bounded by that
    (each shard but the last pads less than one chunk), so the search stops there.
    """
    sizes = [hi - lo for lo, hi in itertools.pairwise(bounds)]
    n, widest = bounds[-1], max(sizes)
    j = 1
    while True:
        chunk = min(target, math.ceil(widest / j))
        padding = sum(math.ceil(s / chunk) * chunk - s for s in sizes[:-1])
        if chunk == 1 or 16 * padding <= n:
            return chunk
        j = max(j + 1, math.ceil(widest / chunk))


def partition_shards(layout: Layout, bounds: Sequence[int]) -> list[list[int]]:
    """For every partition, the shards inside its range (the only ones it talks to).

    Examples
    --------
    >>> partition_shards(partition_layout([0, 6, 10], shards_per_partition=2), [0, 6, 10])
    [[0, 1], [2, 3]]
    """
    out: list[list[int]] = []
    for lo, hi in itertools.pairwise(bounds):
        inside = [i for i, (a, z) in enumerate(layout.ranges()) if lo <= a and z <= hi]
        if not inside or layout.ranges()[inside[0]][0] != lo or layout.ranges()[inside[-1]][1] != hi:
            raise InvalidOptionError(
                f"the layout's shards are not aligned to the partition range [{lo}, {hi}); build the "
                "layout with storage.partition_layout"
            )
        out.append(inside)
    return out
