from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.errors import InvalidOptionError
from distbelief.storage import Layout


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 10**9), shards=st.integers(1, 64), target=st.integers(1, 1 << 22))
def test_split_partitions_into_balanced_chunk_aligned_ranges(n: int, shards: int, target: int) -> None:
    shards = min(shards, n)
    layout = Layout.split(n, shards, target_chunk=target)
    ranges = layout.ranges()
    assert len(ranges) == shards
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (_, hi), (lo2, _) in itertools.pairwise(ranges):
        assert hi == lo2
    for lo, hi in ranges:
        assert hi > lo, "every shard owns at least one parameter"
        assert lo % layout.chunk == 0, "every shard starts on a chunk boundary"
    assert layout.offsets() == layout.bounds[:-1] and layout.stored_size == n and not layout.padded
    sizes = [hi - lo for lo, hi in ranges]
    # Balanced to within one chunk (the last shard may also hold a short final chunk).
    assert max(sizes) - min(sizes) <= 2 * layout.chunk


def test_layout_round_trips_through_dict() -> None:
    layout = Layout.split(1000, 3, target_chunk=64)
    assert Layout.from_dict(layout.to_dict()) == layout


@pytest.mark.parametrize(("n", "shards"), [(0, 1), (5, 0), (5, 6), (-1, 1), (3.5, 1)])
def test_split_refuses_impossible_requests(n: int, shards: int) -> None:
    with pytest.raises(InvalidOptionError):
        Layout.split(n, shards)


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), chunk=st.integers(1, 50))
def test_offsets_put_every_shard_on_chunks_of_its_own(sizes: list[int], chunk: int) -> None:
    bounds = tuple(itertools.accumulate(sizes, initial=0))
    layout = Layout(n=bounds[-1], chunk=chunk, bounds=bounds)
    offsets = layout.offsets()
    # The chunk indices each shard's stored range touches: disjoint between shards, in order.
    touched = [set(range(o // chunk, (o + s - 1) // chunk + 1)) for o, s in zip(offsets, sizes, strict=True)]
    assert all(o % chunk == 0 for o in offsets)
    for a, b in itertools.pairwise(touched):
        assert max(a) < min(b)
    assert layout.stored_size == offsets[-1] + sizes[-1] >= layout.n
    assert layout.padded == any(b % chunk for b in bounds[1:-1])
