"""How a vector of ``n`` parameters is cut into shards that line up with the zarr chunk grid.

Each shard owns a contiguous range ``[lo, hi)`` of the vector, stored in whole zarr chunks of its own, so
during a checkpoint no two shards ever write the same chunk (DESIGN.md, "The parameter server").

When every shard boundary is a multiple of the chunk (:meth:`Layout.split`), a shard's range in the stored
array is its range in the vector. Shard boundaries fixed by something else (a model's partitions,
:func:`storage.partition_layout`) need not be: asking the chunk to divide them all made it a single element
(266,610 one-value chunks for ``MLP([784, 300, 100, 10])`` in 4 partitions; writing them took minutes).
Instead each shard's stored range starts on the next chunk boundary after the previous one's
(:meth:`Layout.offsets`); the gap between is padding that stays at the fill value and is never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distbelief.errors import InvalidOptionError

__all__ = ["DEFAULT_TARGET_CHUNK", "Layout"]

#: Elements per zarr chunk we aim for: 1 Mi float64 = 8 MiB, large enough that zarr's per-chunk overhead is
#: negligible and small enough that shards stay balanced.
DEFAULT_TARGET_CHUNK = 1 << 20


@dataclass(frozen=True)
class Layout:
    """The split of ``n`` parameters into ``len(bounds) - 1`` chunk-aligned shards.

    Parameters
    ----------
    n : int
        Number of parameters.
    chunk : int
        Elements per zarr chunk.
    bounds : tuple of int
        ``bounds[i]:bounds[i+1]`` is shard ``i``'s range. Shard ``i`` is stored at
        ``offsets()[i]:offsets()[i] + size``, starting on a chunk boundary (the bound itself when every
        bound is a multiple of ``chunk``).

    Examples
    --------
    >>> Layout.split(10, 3).ranges()  # chunks of 4: every inner bound is a multiple of it
    [(0, 4), (4, 8), (8, 10)]
    >>> Layout.split(10, 3).offsets()  # so shards are stored where they are in the vector
    (0, 4, 8)
    >>> padded = Layout(n=10, chunk=4, bounds=(0, 5, 10))  # 5 is not a multiple of 4
    >>> padded.offsets(), padded.stored_size  # shard 1 starts at the next chunk, stored[5:8] is padding
    ((0, 8), 13)
    """

    n: int
    chunk: int
    bounds: tuple[int, ...]

    @classmethod
    def split(cls, n: int, shards: int, *, target_chunk: int = DEFAULT_TARGET_CHUNK) -> Layout:
        """Split ``n`` parameters into ``shards`` balanced, chunk-aligned, non-empty ranges."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidOptionError(f"n must be a positive integer number of parameters, got {n!r}")
        if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= n:
            raise InvalidOptionError(
                f"shards must be an integer between 1 and n={n}, got {shards!r}; use fewer shards"
            )
        if target_chunk < 1:
            raise InvalidOptionError(f"target_chunk must be >= 1, got {target_chunk}")
        # Give every shard the same number k of chunks where possible, so shards differ by < one chunk.
        per_shard_chunks = math.ceil(n / (shards * target_chunk))
        chunk = math.ceil(n / (shards * per_shard_chunks))
        if math.ceil(n / chunk) < shards:
            # Small n: rounding left fewer chunks than shards. Chunks of floor(n / shards) always suffice.
            chunk = max(1, n // shards)
        n_chunks = math.ceil(n / chunk)
        bounds = [min(n, (i * n_chunks // shards) * chunk) for i in range(shards)] + [n]
        return cls(n=n, chunk=chunk, bounds=tuple(bounds))

    @property
    def shards(self) -> int:
        """Number of shards."""
        return len(self.bounds) - 1

    def ranges(self) -> list[tuple[int, int]]:
        """``[(lo, hi), ...]`` for every shard."""
        return [(self.bounds[i], self.bounds[i + 1]) for i in range(self.shards)]

    def offsets(self) -> tuple[int, ...]:
        """Where each shard's range starts in the stored (zarr) arrays: on a chunk boundary, right after
        the chunks of the shard before it (padding fills the rest of that shard's last chunk)."""
        out = [0]
        for lo, hi in self.ranges()[:-1]:
            out.append(out[-1] + -(-(hi - lo) // self.chunk) * self.chunk)
        return tuple(out)

    @property
    def stored_size(self) -> int:
        """Length of the stored arrays: ``n`` plus the padding after every shard but the last."""
        return self.offsets()[-1] + self.bounds[-1] - self.bounds[-2]

    @property
    def padded(self) -> bool:
        """Whether a shard is stored away from its place in the vector (a bound is not a chunk multiple)."""
        return self.offsets() != self.bounds[:-1]

    def to_dict(self) -> dict[str, object]:
        """A JSON-able form, stored in the zarr attributes."""
        return {"n": self.n, "chunk": self.chunk, "bounds": list(self.bounds)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Layout:
        """Inverse of :meth:`to_dict`."""
        bounds = data["bounds"]
        assert isinstance(bounds, list)
        return cls(n=int(data["n"]), chunk=int(data["chunk"]), bounds=tuple(int(b) for b in bounds))  # type: ignore[call-overload]
