"""A shard's named vectors within a memory budget: hot ones in RAM, cold ones spilled to local files.

DESIGN.md, "Memory arithmetic on this box": L-BFGS with ``m = 10`` keeps ``2(m + 1)`` history slots beside
``x``, ``g``, the direction and a trial point, ~26 vectors of 0.8 GB at 1e8 parameters: more than the box
holds beside the data. History vectors are touched about twice per iteration (their new Gram entries and
the direction), so they can live on local disk and be streamed. :class:`VectorStore` is the mapping a
:class:`~storage._shard.Shard` keeps as ``self.vectors``: a vector that fits the budget stays a numpy
array; one that does not goes to a raw float64 file (one per vector) in a spill directory.

Spilled vectors are read and written two ways:

* :func:`run_chunked` runs a shard op over fixed-size chunks (:data:`SPILL_CHUNK` elements): each spilled
  operand's chunk is read with ``preadv`` into a reused buffer, the op's own in-RAM code runs on the chunk
  views, and written operands are ``pwrite``-n back. Memory stays bounded by a few chunk buffers, and the
  page cache (not the process) holds whatever the kernel chooses to keep. Elementwise ops give exactly the
  in-RAM bits; reductions (``dot``) sum per-chunk partials, which rounds differently in the last bits.
* ``store[name]`` of a spilled vector returns a ``numpy.memmap`` of its file, for everything else (a
  checkpoint write, a fetch, an op this module does not know): correct, paged in by the kernel.

Vectors are float64, or float32 when an op asks for it (the L-BFGS history with ``history_dtype="float32"``,
issue 29): a float32 vector takes half the RAM of the budget, and spills to a raw float32 file that the
chunked ops read into float32 buffers, at half the bytes.

Placement: a new vector goes to RAM while the RAM vectors fit the budget. A *cold* one (by name,
:data:`COLD_NAME`: the L-BFGS history slots ``hs0..hsm``, ``hy0..hym``) beyond the budget is spilled; a hot
one beyond the budget first evicts cold RAM vectors to disk, and is itself spilled only when no cold vector
is left in RAM.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError

__all__ = [
    "COLD_NAME",
    "DTYPES",
    "SHARD_MEMORY_FRACTION",
    "SPILL_CHUNK",
    "VectorStore",
    "default_budget",
    "op_operands",
    "run_chunked",
    "storage_dtype",
]

#: Names of vectors spilled first: the L-BFGS history slots (Sandblaster's ``hs3``, ``hy10``; ``s3``,
#: ``lbfgs.s0`` ...). Sandblaster's slots are named ``h...`` (``VLBFGSHistory(prefix="h")``): without them
#: here its history counted as hot, and a shard restored from a checkpoint (vectors read in name order,
#: ``hs*`` before ``xa``) kept the history in RAM and spilled ``x``.
COLD_NAME = re.compile(r"(^h?|[._])[sy]\d+$")

#: Elements per chunk when streaming a spilled vector (4 Mi float64 = 32 MiB per operand buffer).
SPILL_CHUNK = 1 << 22

#: The dtypes a vector may be stored in; anything else is stored as float64.
DTYPES = (np.dtype(np.float64), np.dtype(np.float32))


def storage_dtype(dtype: Any) -> np.dtype[Any]:
    """The dtype a vector of ``dtype`` is kept in: float32 stays float32, everything else is float64.

    Examples
    --------
    >>> storage_dtype(np.float32), storage_dtype(np.int64)
    (dtype('float32'), dtype('float64'))
    """
    dt = np.dtype(dtype)
    return dt if dt in DTYPES else DTYPES[0]


#: Share of a worker's ``memory_limit`` its shards may keep in RAM by default (the rest is for the
#: replicas' rows, their copies of ``x`` and gradient, and Dask's own buffers).
SHARD_MEMORY_FRACTION = 0.4


def default_budget(shards_on_worker: int = 1) -> int | None:
    """Bytes one shard may keep in RAM: :data:`SHARD_MEMORY_FRACTION` of this worker's ``memory_limit``,
    split over its shards; ``None`` (no limit) outside a worker or when the worker has no memory limit.

    Examples
    --------
    >>> default_budget() is None   # not on a Dask worker
    True
    """
    try:
        from distributed import get_worker

        limit = get_worker().memory_manager.memory_limit
    except (ImportError, ValueError, AttributeError):
        return None
    if not limit:
        return None
    return int(SHARD_MEMORY_FRACTION * limit / max(1, shards_on_worker))


#: op -> (names it reads, names it writes), from the op's arguments. Every op here is elementwise over the
#: shard's range, so it can run chunk by chunk.
def _names(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [n for v in value for n in _names(v)]


_OPERANDS: dict[str, Callable[..., tuple[list[str], list[str]]]] = {
    "fill": lambda name, value: ([], [name]),
    "copy": lambda src, dst: ([src], [dst]),
    "scale": lambda alpha, name: ([name], [name]),
    "axpy": lambda alpha, x, y: ([x, y], [y]),
    "lincomb": lambda dst, coeffs, names, dtype=None: (_names(names), [dst]),
    "mul": lambda x, y, dst: ([x, y], [dst]),
    "dot": lambda a, b: ([a, b], []),
    "dots": lambda pairs: (_names(pairs), []),
    "norm2": lambda name: ([name], []),
    "norm_inf": lambda name: ([name], []),
    "sum": lambda name: ([name], []),
}


def op_operands(op: Sequence[Any]) -> tuple[list[str], list[str]] | None:
    """``(read, written)`` vector names of a shard op, or ``None`` if the op cannot run chunk-wise.

    Examples
    --------
    >>> op_operands(("axpy", 2.0, "d", "x"))
    (['d', 'x'], ['x'])
    >>> op_operands(("reset_acc", "g", 3)) is None
    True
    """
    rule = _OPERANDS.get(op[0])
    return None if rule is None else rule(*op[1:])


class VectorStore(MutableMapping[str, np.ndarray]):
    """Named vectors of ``size`` elements (float64, or float32), kept in RAM up to ``budget`` bytes, the
    rest on disk.

    Parameters
    ----------
    size : int
        Elements per vector (the shard's range).
    budget : int, optional
        Bytes of vectors to keep in RAM; ``None``: no limit (a plain in-RAM mapping, nothing spilled).
    spill_dir : str, optional
        Local directory for spilled vectors (default: a new temporary directory, made on first spill and
        removed by :meth:`close`).
    cold : callable, optional
        ``cold(name)``: whether a vector is spilled first (default: :data:`COLD_NAME` matches).

    Examples
    --------
    >>> vs = VectorStore(4, budget=32)
    >>> vs["x"] = np.arange(4.0); vs["s0"] = np.ones(4)
    >>> sorted(vs.spilled), float(vs["s0"].sum())
    (['s0'], 4.0)
    >>> vs["y0"] = np.ones(4, dtype=np.float32); vs["y0"].dtype   # spilled as float32
    dtype('float32')
    >>> vs.close()
    """

    def __init__(
        self,
        size: int,
        budget: int | None = None,
        *,
        spill_dir: str | None = None,
        cold: Callable[[str], bool] | None = None,
    ) -> None:
        if budget is not None and budget < 0:
            raise InvalidOptionError(f"memory budget must be >= 0 bytes or None (no limit), got {budget}")
        self.size = size
        self.budget = budget
        self._cold = cold or (lambda name: COLD_NAME.search(name) is not None)
        self._ram: dict[str, np.ndarray] = {}
        self._files: dict[str, str] = {}  # spilled name -> path
        self._file_dtypes: dict[str, np.dtype[Any]] = {}  # spilled name -> its file's dtype
        self._narrow: set[str] = set()  # names of the vectors not stored as float64
        self._maps: dict[str, np.memmap] = {}  # opened whole-vector maps, so one name keeps one object
        self._dir = spill_dir
        self._own_dir = False
        #: Bytes read from and written to spill files by :func:`run_chunked` and :meth:`spill`.
        self.bytes_read = 0
        self.bytes_written = 0
        #: Seconds spent in those reads and writes (where a spilled run's shard time goes).
        self.seconds_read = 0.0
        self.seconds_written = 0.0

    # -- mapping ---------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        vec = self._ram.get(name)
        if vec is not None:
            return vec
        if name not in self._files:
            raise KeyError(name)
        mapped = self._maps.get(name)
        if mapped is None:
            path, dtype = self._files[name], self._file_dtypes[name]
            mapped = self._maps[name] = np.memmap(path, dtype=dtype, mode="r+")
        return mapped

    def __setitem__(self, name: str, values: np.ndarray) -> None:
        """Keep ``values`` (the array itself when it stays in RAM, as a dict would) under ``name``.

        A float32 array stays float32; an array of another dtype goes to disk as float64.
        """
        dtype = storage_dtype(values.dtype)
        if name in self._files:
            if self._file_dtypes[name] != dtype:
                del self[name]  # another dtype: a file of its own
            else:
                self._write_file(name, values)
                return
        self._ram.pop(name, None)
        if self._place_in_ram(name, dtype.itemsize):
            self._ram[name] = values
        else:
            self._write_file(name, values)
        self._note_dtype(name, dtype)

    def __delitem__(self, name: str) -> None:
        self._narrow.discard(name)
        if name in self._ram:
            del self._ram[name]
            return
        path = self._files.pop(name)  # KeyError when absent, as a dict
        del self._file_dtypes[name]
        self._maps.pop(name, None)
        os.remove(path)

    def __iter__(self) -> Iterator[str]:
        yield from self._ram
        yield from self._files

    def __len__(self) -> int:
        return len(self._ram) + len(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._ram or name in self._files

    # -- placement -------------------------------------------------------------------------------------
    @property
    def spilled(self) -> set[str]:
        """Names of the vectors on disk."""
        return set(self._files)

    @property
    def ram_bytes(self) -> int:
        """Bytes of the vectors held in RAM."""
        return sum(v.nbytes for v in self._ram.values())

    def is_spilled(self, name: str) -> bool:
        """Whether ``name`` lives on disk."""
        return name in self._files

    def dtype_of(self, name: str) -> np.dtype[Any]:
        """The dtype vector ``name`` is stored in (KeyError when there is none)."""
        vec = self._ram.get(name)
        return vec.dtype if vec is not None else self._file_dtypes[name]

    def create(self, name: str, dtype: Any = np.float64) -> np.ndarray:
        """A new uninitialised vector ``name`` of ``dtype`` (float64 or float32; in RAM or on disk, by the
        budget), returned for writing."""
        dt = storage_dtype(dtype)
        self._note_dtype(name, dt)
        if self._place_in_ram(name, dt.itemsize):
            vec = self._ram[name] = np.empty(self.size, dtype=dt)
            return vec
        self._new_file(name, dt)
        return self[name]

    def _note_dtype(self, name: str, dtype: np.dtype[Any]) -> None:
        if dtype == DTYPES[0]:
            self._narrow.discard(name)
        else:
            self._narrow.add(name)

    @property
    def holds_narrow(self) -> bool:
        """Whether some vector is stored as float32 (its dot products then go through
        :func:`storage._kernels.dots_mixed`)."""
        return bool(self._narrow)

    def _place_in_ram(self, name: str, itemsize: int = 8) -> bool:
        if self.budget is None:
            return True
        need = itemsize * self.size
        if self.ram_bytes + need <= self.budget:
            return True
        if self._cold(name):
            return False
        for victim in [n for n in self._ram if self._cold(n)]:
            self.spill(victim)
            if self.ram_bytes + need <= self.budget:
                return True
        return False

    def spill(self, name: str) -> None:
        """Move RAM vector ``name`` to its file (nothing if it is on disk already)."""
        vec = self._ram.pop(name, None)
        if vec is not None:
            self._write_file(name, vec)

    # -- files -----------------------------------------------------------------------------------------
    def _new_file(self, name: str, dtype: np.dtype[Any]) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="shard-spill-")
            self._own_dir = True
        os.makedirs(self._dir, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        # A name of its own, made atomically: the shards of one worker may share a spill directory, and
        # names can sanitize alike ("a b", "a_b"); two vectors in one file would overwrite each other.
        fd, path = tempfile.mkstemp(prefix=f"{safe}-", suffix=f".f{8 * dtype.itemsize}", dir=self._dir)
        with os.fdopen(fd, "wb") as f:
            f.truncate(dtype.itemsize * self.size)  # sparse file: no disk written until the op fills it
        self._files[name] = path
        self._file_dtypes[name] = dtype
        return path

    def _write_file(self, name: str, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self._file_dtypes.get(name, storage_dtype(values.dtype)))
        if values.shape != (self.size,):
            raise InvalidOptionError(f"vector {name!r} needs {self.size} values, got shape {values.shape}")
        path = self._files.get(name) or self._new_file(name, values.dtype)
        mapped = self._maps.get(name)
        if mapped is not None and np.shares_memory(mapped, values):
            return
        fd = os.open(path, os.O_WRONLY)
        try:
            for a in range(0, self.size, SPILL_CHUNK):
                b = min(self.size, a + SPILL_CHUNK)
                self._pwrite(fd, values[a:b], a)
        finally:
            os.close(fd)

    def _pwrite(self, fd: int, chunk: np.ndarray, start: int) -> None:
        t0 = time.perf_counter()
        view = np.ascontiguousarray(chunk).data.cast("B")
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], chunk.itemsize * start + done)
        self.bytes_written += view.nbytes
        self.seconds_written += time.perf_counter() - t0

    def _pread(self, fd: int, out: np.ndarray, start: int) -> None:
        t0 = time.perf_counter()
        view = out.data.cast("B")  # out is a contiguous buffer: read straight into it
        done = 0
        while done < view.nbytes:
            got = os.preadv(fd, [view[done:]], out.itemsize * start + done)
            if got == 0:
                raise OSError(f"spill file ended early at element {start}")
            done += got
        self.bytes_read += view.nbytes
        self.seconds_read += time.perf_counter() - t0

    def close(self) -> None:
        """Remove every spilled file (and the spill directory this store made)."""
        self._maps.clear()
        for path in self._files.values():
            if os.path.exists(path):
                os.remove(path)
        self._files.clear()
        self._file_dtypes.clear()
        self._narrow.clear()
        if self._own_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def run_chunked(
    store: VectorStore, op: Sequence[Any], handler: Callable[[dict[str, np.ndarray], int], Any]
) -> Any:
    """Run elementwise shard op ``op`` chunk by chunk over ``store``; combine partial results.

    ``handler(views, n)`` runs the op's in-RAM code on ``views`` (name -> chunk of ``n`` elements) and
    returns its partial result. Sums (``dot``, ``dots``, ``norm2``, ``sum``) add the chunks' partials,
    ``norm_inf`` takes their maximum.

    Examples
    --------
    >>> vs = VectorStore(5, budget=0)
    >>> vs["s0"] = np.arange(5.0)
    >>> run_chunked(vs, ("dot", "s0", "s0"), lambda v, n: float(v["s0"] @ v["s0"]))
    30.0
    >>> vs.close()
    """
    operands = op_operands(op)
    if operands is None:
        raise InvalidOptionError(f"op {op[0]!r} cannot run chunk-wise; use the store's memmap view")
    reads, writes = operands
    for name in writes:
        if name not in store:
            store.create(name)
    names = list(dict.fromkeys(reads + writes))
    read_set = set(reads)
    chunk = min(SPILL_CHUNK, max(1, store.size))
    buffers = {n: np.empty(chunk, dtype=store.dtype_of(n)) for n in names if store.is_spilled(n)}
    fds = {n: os.open(store._files[n], os.O_RDWR) for n in buffers}
    partials: list[Any] = []
    try:
        for a in range(0, store.size, chunk):
            b = min(store.size, a + chunk)
            views: dict[str, np.ndarray] = {}
            for n in names:
                if n in buffers:
                    views[n] = buffers[n][: b - a]
                    if n in read_set:  # a write-only destination need not be read
                        store._pread(fds[n], views[n], a)
                else:
                    views[n] = store[n][a:b]
            partials.append(handler(views, b - a))
            for n in writes:
                if n in buffers:
                    store._pwrite(fds[n], views[n], a)
    finally:
        for fd in fds.values():
            os.close(fd)
    return _combine(op[0], partials)


def _combine(kind: str, partials: list[Any]) -> Any:
    if kind in ("dot", "norm2", "sum"):
        return float(sum(partials)) if partials else 0.0
    if kind == "norm_inf":
        return max(partials) if partials else 0.0
    if kind == "dots":
        return [float(sum(col)) for col in zip(*partials, strict=True)] if partials else []
    return None
