"""How a vector of ``n`` parameters is cut into shards that line up with the zarr chunk grid.

Each shard owns a contiguous range ``[lo, hi)`` made of whole zarr chunks, so during a checkpoint no two
shards ever write the same chunk (DESIGN.md, "The parameter server").
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
        ``bounds[i]:bounds[i+1]`` is shard ``i``'s range; every bound but the last is a multiple of
        ``chunk``.

    Examples
    --------
    >>> Layout.split(10, 3).ranges()  # chunks of 4: every inner bound is a multiple of it
    [(0, 4), (4, 8), (8, 10)]
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

    def to_dict(self) -> dict[str, object]:
        """A JSON-able form, stored in the zarr attributes."""
        return {"n": self.n, "chunk": self.chunk, "bounds": list(self.bounds)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Layout:
        """Inverse of :meth:`to_dict`."""
        bounds = data["bounds"]
        assert isinstance(bounds, list)
        return cls(n=int(data["n"]), chunk=int(data["chunk"]), bounds=tuple(int(b) for b in bounds))  # type: ignore[call-overload]
