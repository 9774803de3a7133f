"""A per-process cache of dataset rows, so that replicas on a worker read each portion from zarr once.

Model replicas are created for one run and released after it, but their worker lives on: runs after the
first on the same dataset (the service's jobs, a regularization path, a benchmark's repeats) find the rows
already in the worker's memory, as a persisted Dask array would be, instead of reading hundreds of MB from
the store again. zarr stays the source of truth; this is only a cache.

* Keyed by the dataset's id (a fresh uuid each time a dataset is written, so rewriting a dataset at the same
  path never serves the old rows) and a row range. A request inside a cached range is served as views.
* Bounded: least recently used ranges are dropped beyond the byte budget, by default a quarter of the
  worker's memory limit (a quarter of the machine's memory outside a worker), or
  ``DISTBELIEF_ROW_CACHE_BYTES`` (0 turns the cache off).
* Sparse datasets work the same: their rows are ``scipy.sparse.csr_array`` (its arrays read-only), counted
  by their ``data``, ``indices`` and ``indptr`` bytes; a sub-range of a cached range is a row slice (a copy,
  as scipy has no views of CSR rows), the exact range is the cached matrix itself.
* The cached arrays are read-only: every replica on the worker shares them, and a model that wrote into
  its input would corrupt the others' rows, so it fails loudly instead.

Examples
--------
>>> import numpy as np, os, tempfile
>>> from distbelief.storage import Dataset, RowCache
>>> path = os.path.join(tempfile.mkdtemp(), "d")
>>> ds = Dataset.from_arrays(np.arange(8.0).reshape(4, 2), np.zeros(4), path=path)
>>> cache = RowCache(budget_bytes=1 << 20)
>>> X, y = cache.rows(ds, 0, 4)      # read from zarr
>>> X2, _ = cache.rows(ds, 1, 3)     # a view of the cached range
>>> X2.tolist(), cache.stats()["hits"]
([[2.0, 3.0], [4.0, 5.0]], 1)
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ._sparse import freeze, nbytes

__all__ = ["ROW_CACHE_ENV", "RowCache", "default_row_cache"]

ROW_CACHE_ENV = "DISTBELIEF_ROW_CACHE_BYTES"
FloatArray = npt.NDArray[np.float64]
_Key = tuple[str, int, int]
T = TypeVar("T")


class RowCache:
    """LRU cache of ``(X, y)`` row ranges of datasets, bounded in bytes and safe to share between threads.

    Parameters
    ----------
    budget_bytes : int
        Keep at most this many bytes of rows (0: cache nothing).
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self._entries: OrderedDict[_Key, tuple[FloatArray, FloatArray]] = OrderedDict()
        #: What :meth:`derived` computed, by (dataset id, start, stop, tag).
        self._derived: dict[tuple[str, int, int, str], Any] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def rows(self, dataset: Any, start: int, stop: int) -> tuple[FloatArray, FloatArray]:
        """``(X[start:stop], y[start:stop])`` of ``dataset``, from memory when a cached range holds them.

        Parameters
        ----------
        dataset : storage.Dataset
            Anything with ``dataset_id`` and ``read_rows(start, stop)``.
        start, stop : int
            Row range.

        Returns
        -------
        (X, y) : read-only float64 arrays (views of a cached range, or the range just read).
        """
        dataset_id = str(dataset.dataset_id)
        found = self._lookup(dataset_id, start, stop)
        if found is not None:
            return found
        # Read outside the lock: two threads may read the same range at once; the second insert wins.
        X, y = dataset.read_rows(start, stop)
        freeze(X)
        freeze(y)
        self._insert((dataset_id, start, stop), X, y)
        return X, y

    def derived(self, dataset: Any, start: int, stop: int, tag: str, make: Callable[[Any, Any], T]) -> T:
        """``make(X, y)`` of rows ``[start, stop)``, computed once and kept beside the cached rows.

        For what a replica derives from a portion's rows every time it uses them, such as a sparse
        portion's keys (the parameters its rows touch, for key-value pull and push: storage._keys). Dropped
        with the row range that holds it; not kept (computed each call) when the rows are not cached.

        Examples
        --------
        >>> import numpy as np, os, tempfile
        >>> from distbelief.storage import Dataset
        >>> ds = Dataset.from_arrays(np.eye(2), np.zeros(2), path=os.path.join(tempfile.mkdtemp(), "d"))
        >>> cache = RowCache(1 << 20)
        >>> cache.derived(ds, 0, 2, "rows", lambda X, y: X.shape[0])
        2
        """
        key = (str(dataset.dataset_id), start, stop, tag)
        with self._lock:
            if key in self._derived:
                hit: T = self._derived[key]
                return hit
        X, y = self.rows(dataset, start, stop)
        value = make(X, y)
        with self._lock:
            if any(k[0] == key[0] and k[1] <= start and stop <= k[2] for k in self._entries):
                self._derived[key] = value
        return value

    def holds(self, dataset: Any, start: int, stop: int) -> bool:
        """Whether rows ``[start, stop)`` of ``dataset`` are in memory (no read, the LRU order unchanged)."""
        dataset_id = str(dataset.dataset_id)
        with self._lock:
            return any(k[0] == dataset_id and k[1] <= start and stop <= k[2] for k in self._entries)

    def ranges(self, dataset: Any) -> list[tuple[int, int]]:
        """The row ranges of ``dataset`` held in memory, in row order."""
        dataset_id = str(dataset.dataset_id)
        with self._lock:
            return sorted((lo, hi) for key_id, lo, hi in self._entries if key_id == dataset_id)

    def _lookup(self, dataset_id: str, start: int, stop: int) -> tuple[FloatArray, FloatArray] | None:
        with self._lock:
            for key, (X, y) in self._entries.items():
                key_id, lo, hi = key
                if key_id == dataset_id and lo <= start and stop <= hi:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    if (lo, hi) == (start, stop):
                        return X, y  # a sparse X would be copied by slicing
                    return X[start - lo : stop - lo], y[start - lo : stop - lo]
            self.misses += 1
            return None

    def _insert(self, key: _Key, X: FloatArray, y: FloatArray) -> None:
        size = nbytes(X) + y.nbytes
        if size > self.budget_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= nbytes(old[0]) + old[1].nbytes
            self._entries[key] = (X, y)
            self._bytes += size
            while self._bytes > self.budget_bytes:
                gone, (X_old, y_old) = self._entries.popitem(last=False)
                self._bytes -= nbytes(X_old) + y_old.nbytes
                self._drop_derived(gone)

    def _drop_derived(self, gone: _Key) -> None:
        """Forget what was derived from rows inside the evicted range ``gone`` (lock held)."""
        for key in [k for k in self._derived if k[0] == gone[0] and gone[1] <= k[1] and k[2] <= gone[2]]:
            del self._derived[key]

    def clear(self) -> None:
        """Drop every cached range."""
        with self._lock:
            self._entries.clear()
            self._derived.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        """``{"entries", "bytes", "budget_bytes", "hits", "misses"}``."""
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self._bytes,
                "budget_bytes": self.budget_bytes,
                "hits": self.hits,
                "misses": self.misses,
            }


_default: RowCache | None = None
_default_lock = threading.Lock()


def _default_budget() -> int:
    configured = os.environ.get(ROW_CACHE_ENV)
    if configured is not None:
        return int(configured)
    limit = 0
    try:
        from distributed import get_worker

        limit = int(get_worker().memory_manager.memory_limit or 0)
    except (ValueError, AttributeError):
        pass
    if not limit:
        try:
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            limit = 4 << 30
    return limit // 4


def default_row_cache() -> RowCache:
    """The process-wide cache that model replicas read their portions through (created on first use).

    Examples
    --------
    >>> from distbelief.storage import default_row_cache
    >>> default_row_cache() is default_row_cache()
    True
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = RowCache(_default_budget())
        return _default
