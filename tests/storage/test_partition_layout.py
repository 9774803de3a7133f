"""Shards aligned to a model's partitions (paper, Figure 2)."""

from __future__ import annotations

import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from distbelief import models
from distbelief.errors import InvalidOptionError
from distbelief.storage import _partition_layout, partition_layout, partition_shards


@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=5),
    per=st.integers(1, 3),
    target=st.integers(1, 64),
)
def test_every_partition_boundary_is_a_shard_boundary(sizes: list[int], per: int, target: int) -> None:
    bounds = np.cumsum([0, *sizes]).tolist()
    layout = partition_layout(bounds, shards_per_partition=per, target_chunk=target)
    assert set(bounds) <= set(layout.bounds)
    assert layout.chunk <= target and all(b % layout.chunk == 0 for b in layout.bounds[:-1])
    owned = partition_shards(layout, bounds)
    assert sorted(i for shards in owned for i in shards) == list(range(layout.shards))
    for (lo, hi), shards in zip(itertools.pairwise(bounds), owned, strict=True):
        assert layout.ranges()[shards[0]][0] == lo and layout.ranges()[shards[-1]][1] == hi


def test_a_models_partitions_own_their_shards() -> None:
    plan = models.partition_plan(models.LocallyConnected(40, 3, fields=[5, 3]), 3)
    layout = partition_layout(plan.bounds)
    assert layout.ranges() == list(zip(plan.bounds[:-1], plan.bounds[1:], strict=True))


def test_empty_partitions_and_unaligned_layouts_are_refused() -> None:
    with pytest.raises(InvalidOptionError, match="use fewer partitions"):
        partition_layout([0, 4, 4, 9])
    with pytest.raises(InvalidOptionError, match="not aligned"):
        partition_shards(partition_layout([0, 5, 10]), [0, 3, 10])


def test_examples_run() -> None:
    result = doctest.testmod(_partition_layout, verbose=False)
    assert result.attempted > 0 and result.failed == 0
