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
    assert layout.chunk <= target and all(o % layout.chunk == 0 for o in layout.offsets())
    assert 16 * (layout.stored_size - layout.n) <= layout.n, "padding stays under n/16"
    owned = partition_shards(layout, bounds)
    assert sorted(i for shards in owned for i in shards) == list(range(layout.shards))
    for (lo, hi), shards in zip(itertools.pairwise(bounds), owned, strict=True):
        assert layout.ranges()[shards[0]][0] == lo and layout.ranges()[shards[-1]][1] == hi


def test_a_models_partitions_own_their_shards() -> None:
    plan = models.partition_plan(models.LocallyConnected(40, 3, fields=[5, 3]), 3)
    layout = partition_layout(plan.bounds)
    assert layout.ranges() == list(zip(plan.bounds[:-1], plan.bounds[1:], strict=True))


@pytest.mark.parametrize(
    ("model", "partitions"),
    [
        (models.MLP([784, 300, 100, 10]), 4),  # the chunk was 1: 266,610 chunks of one value
        (models.LocallyConnected(4096, 10, fields=[7, 5]), 3),  # the chunk was 2
        (models.LocallyConnected(64, 10, fields=[5, 3]), 3),  # the chunk was 2 (n = 1182)
    ],
)
def test_partitioned_models_get_chunks_of_a_sane_size(model: models.Model, partitions: int) -> None:
    plan = models.partition_plan(model, partitions)
    for per in (1, 2):
        layout = partition_layout(plan.bounds, shards_per_partition=per)
        widest = max(hi - lo for lo, hi in layout.ranges())
        # Every shard in at most two chunks, and each chunk thousands of values once the model has them.
        assert layout.chunk >= min(4096, widest // 2)
        assert all(-(-(hi - lo) // layout.chunk) <= 2 for lo, hi in layout.ranges())
        assert 16 * (layout.stored_size - layout.n) <= layout.n


def test_empty_partitions_and_unaligned_layouts_are_refused() -> None:
    with pytest.raises(InvalidOptionError, match="use fewer partitions"):
        partition_layout([0, 4, 4, 9])
    with pytest.raises(InvalidOptionError, match="not aligned"):
        partition_shards(partition_layout([0, 5, 10]), [0, 3, 10])


def test_examples_run() -> None:
    result = doctest.testmod(_partition_layout, verbose=False)
    assert result.attempted > 0 and result.failed == 0
