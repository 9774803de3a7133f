"""Tests of storage._rowcache: cached row ranges equal the dataset's rows, within a byte budget."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distbelief.storage._rowcache as rcmod
from distbelief.storage import Dataset, RowCache, default_row_cache

N, D = 40, 3


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Dataset, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    X, y = rng.normal(size=(N, D)), rng.normal(size=N)
    path = tmp_path_factory.mktemp("rows") / "d"
    return Dataset.from_arrays(X, y, path=str(path), chunk_rows=4, portion_rows=8), X, y


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ranges=st.lists(st.tuples(st.integers(0, N), st.integers(0, N)).map(sorted), min_size=1, max_size=12),
    budget_rows=st.integers(0, 2 * N),
)
def test_any_sequence_of_ranges_returns_the_datasets_rows(
    data: tuple[Dataset, np.ndarray, np.ndarray], ranges: list[list[int]], budget_rows: int
) -> None:
    ds, X, y = data
    cache = RowCache(budget_rows * (D + 1) * 8)
    for start, stop in ranges:
        Xr, yr = cache.rows(ds, start, stop)
        np.testing.assert_array_equal(Xr, X[start:stop])
        np.testing.assert_array_equal(yr, y[start:stop])
        assert cache.stats()["bytes"] <= cache.budget_bytes
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == len(ranges)


def test_a_range_inside_a_cached_one_is_a_view_and_a_hit(
    data: tuple[Dataset, np.ndarray, np.ndarray],
) -> None:
    ds, X, _ = data
    cache = RowCache(1 << 20)
    whole, _ = cache.rows(ds, 8, 24)
    part, _ = cache.rows(ds, 10, 14)
    assert np.shares_memory(part, whole)
    np.testing.assert_array_equal(part, X[10:14])
    assert cache.stats() == {
        "entries": 1,
        "bytes": 16 * (D + 1) * 8,
        "budget_bytes": 1 << 20,
        "hits": 1,
        "misses": 1,
    }
    # A range sticking out of the cached one is read again.
    cache.rows(ds, 20, 28)
    assert cache.stats()["misses"] == 2
    assert cache.ranges(ds) == [(8, 24), (20, 28)]


def test_least_recently_used_ranges_go_first(data: tuple[Dataset, np.ndarray, np.ndarray]) -> None:
    ds, _, _ = data
    per_range = 8 * (D + 1) * 8
    cache = RowCache(2 * per_range)
    cache.rows(ds, 0, 8)
    cache.rows(ds, 8, 16)
    cache.rows(ds, 0, 8)  # now 8..16 is the least recently used
    cache.rows(ds, 16, 24)
    before = cache.stats()["misses"]
    cache.rows(ds, 0, 8)
    assert cache.stats()["misses"] == before
    cache.rows(ds, 8, 16)
    assert cache.stats()["misses"] == before + 1


def test_zero_budget_caches_nothing(data: tuple[Dataset, np.ndarray, np.ndarray]) -> None:
    ds, X, _ = data
    cache = RowCache(0)
    for _ in range(2):
        np.testing.assert_array_equal(cache.rows(ds, 0, 8)[0], X[:8])
    assert cache.stats()["entries"] == 0 and cache.stats()["misses"] == 2


def test_cached_rows_are_read_only(data: tuple[Dataset, np.ndarray, np.ndarray]) -> None:
    ds, _, _ = data
    X, y = RowCache(1 << 20).rows(ds, 0, 8)
    with pytest.raises(ValueError, match="read-only"):
        X[0, 0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        y[0] = 1.0


def test_a_dataset_rewritten_at_the_same_path_is_not_served_stale(tmp_path: Path) -> None:
    path = str(tmp_path / "d")
    cache = RowCache(1 << 20)
    old = Dataset.from_arrays(np.zeros((8, 2)), np.zeros(8), path=path)
    cache.rows(old, 0, 8)
    new = Dataset.from_arrays(np.ones((8, 2)), np.ones(8), path=path, overwrite=True)
    assert new.dataset_id != old.dataset_id
    np.testing.assert_array_equal(cache.rows(new, 0, 8)[0], np.ones((8, 2)))


def test_threads_reading_at_once_all_get_the_rows(data: tuple[Dataset, np.ndarray, np.ndarray]) -> None:
    ds, X, _ = data
    cache = RowCache(1 << 20)
    errors: list[BaseException] = []

    def read(k: int) -> None:
        try:
            for i in range(20):
                lo = (k + i) % 5 * 8
                np.testing.assert_array_equal(cache.rows(ds, lo, lo + 8)[0], X[lo : lo + 8])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.stats()["bytes"] <= 5 * 8 * (D + 1) * 8


def test_default_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rcmod, "_default", None)
    monkeypatch.setenv(rcmod.ROW_CACHE_ENV, "12345")
    assert default_row_cache().budget_bytes == 12345
    assert default_row_cache() is default_row_cache()
    monkeypatch.setattr(rcmod, "_default", None)
    monkeypatch.delenv(rcmod.ROW_CACHE_ENV)
    # Outside a worker: a quarter of the machine's memory.
    assert 0 < default_row_cache().budget_bytes < 1 << 50
